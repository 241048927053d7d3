"""``python -m engine.plan``: see engine/plan/search.py."""
import sys

from engine.plan.search import main

sys.exit(main())
