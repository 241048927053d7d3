"""``python -m engine.checkpoint inspect DIR``."""
import sys

from engine.checkpoint import main

sys.exit(main())
