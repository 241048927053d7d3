"""``python -m engine.fuzz``: see engine/fuzz/cli.py."""
import sys

from engine.fuzz.cli import main

sys.exit(main())
