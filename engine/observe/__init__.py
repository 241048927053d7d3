"""Observation: what a run reports about itself and the faults it watches for.

- ``metrics.py``: the JSONL metrics log, the summary table and the loss plot;
- ``dashboards.py``: TensorBoard and Weights & Biases writers;
- ``utilization.py``: model and executed FLOPs of a run, TFLOP/s, MFU and HFU;
- ``profiling.py``: ``--profile-steps`` through torch.profiler (torch_npu.profiler on Ascend);
- ``anomaly.py``: bad steps (NaN/Inf, loss spikes) and the re-run on anomaly;
- ``stragglers.py``: ranks slower than their peers;
- ``faults.py``: fault injection for the resilience tests.

Imports configuration, device, data and the planner; never the loop.
"""
