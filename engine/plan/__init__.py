"""The cluster planner and the device facts it stands on.

- ``hardware.py``: the device table (dense peaks, memory, link bandwidths per accelerator);
- ``flops.py``: the FLOPs of a training step (Megatron's count, generalised), shared with the
  trainer's MFU;
- ``model.py``: model shape, cluster, layout, topology rules and memory per device;
- ``timing.py``: the step-time estimate of one layout;
- ``search.py``: enumeration, ranking and the command line (``python -m engine.plan``).

See docs/planner.md.
"""
