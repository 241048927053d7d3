"""``python -m engine.export --load DIR --to hf --out DIR2``: see engine/checkpoint/export.py."""
import sys

from engine.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main())
