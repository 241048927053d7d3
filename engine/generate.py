"""``python -m engine.generate --load DIR --prompt TEXT``: see engine/tools/generate.py."""
import sys

from engine.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
