"""The cluster planner and the device facts it stands on.

- ``hardware.py``: the device table (dense peaks per precision, memory, link bandwidths);
- ``flops.py``: the model and executed FLOPs of a training step (Megatron's count, generalised),
  shared with the trainer's MFU and HFU;
- ``placement.py``: rank order, strides, groups and the links they span;
- ``model.py``: model shape, cluster, layout, topology rules and memory per device, by part;
- ``timing.py``: the step-time estimate of one layout, by term;
- ``report.py``: ``--explain`` and the ``torchrun ... -m engine.train`` command of a layout;
- ``search.py``: enumeration, ranking and the command line (``python -m engine.plan``);
- ``arguments.py``: the command line's checks, before any work;
- ``train_check.py``: engine.train's own checks and notes on the flags the planner shares with it.

See docs/planner.md.
"""
