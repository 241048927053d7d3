"""Tools beside the training loop, each behind an entry point of its own.

- ``preflight.py``: ``python -m engine.preflight``, a cluster's agreement (versions, devices,
  communication settings) and its links' bandwidth, before a job;
- ``commbench.py``: the collective benchmark and correctness check the preflight runs;
- ``generate.py``: ``python -m engine.generate``, text from any checkpoint;
- ``plan_cli.py``: ``python -m engine.plan``'s command line (the search is engine/plan/), with
  ``train_check.py``: engine.train's own checks and notes on the flags the planner shares with it.

Imports configuration, device, data, checkpoints and observation; never the loop.
"""
