"""``PYTHONPATH=. python3 -m benchmarks.device_check --out DIR``: the accelerator check in one call
(benchmarks/device_check/run.py)."""
from benchmarks.device_check.run import main

raise SystemExit(main())
