"""Benchmarks, each a ratio or a count against a reference measured in the same run, by what they
measure (each folder's docstring lists its modules):

- ``device_check``: the accelerator check in one call (``python3 -m benchmarks.device_check``);
- ``peers``: this engine against PyTorch's own parallelism, a plain loop, a previous release;
- ``communication``: bytes, calls and overlap between ranks; scaling;
- ``memory``: activations and parameters per rank;
- ``pipeline``: schedules' bubbles, Gantt charts, dry runs of 3D layouts;
- ``convergence``: whether a feature trains what its reference trains;
- ``host``: host time of a step, an MoE layer, kernels, guards and checkpoint saves.

``common``: what the launch-based ones share (layouts, torchrun, tables, JSON lines).
"""
