"""``python -m engine.preflight``: the cluster check; see engine/tools/preflight.py."""
import sys

from engine.tools.preflight import main

if __name__ == "__main__":
    sys.exit(main())
