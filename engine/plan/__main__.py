"""``python -m engine.plan``: the command line is engine/tools/plan_cli.py (it reads engine.train's
model flags and recipes), the search engine/plan/search.py."""
import sys

from engine.tools.plan_cli import main

sys.exit(main())
