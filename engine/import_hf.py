"""``python -m engine.import_hf --load HF_DIR --save CKPT_DIR``: see engine/checkpoint/import_hf.py."""
import sys

from engine.checkpoint.import_hf import main

if __name__ == "__main__":
    sys.exit(main())
