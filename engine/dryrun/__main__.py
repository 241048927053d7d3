"""``python -m engine.dryrun``: see engine/dryrun/cli.py."""
import os
import sys

# each role's fake process group logs a C++ warning when it is destroyed ("No backend of type 0
# found ... Assuming no hooks are registered"), harmless: keep torch's C++ log to errors
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from engine.dryrun.cli import main  # noqa: E402  (after the log level, read when torch loads)

sys.exit(main())
