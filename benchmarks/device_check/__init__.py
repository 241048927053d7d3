"""The accelerator check, run in one call on a CUDA or Ascend machine
(``PYTHONPATH=. python3 -m benchmarks.device_check --out DIR``; ``--allow-cpu --tiny`` on the CPU).

- ``run``: the command, every stage in order under its deadline, the JSON and markdown it writes;
- ``plan``: the stages, their deadlines and models, what every stage shares (engine.train's flags,
  the last line of a log);
- ``launch``: a stage's process under its deadline (a fresh interpreter on a device, a fork of a
  preloaded server on the CPU);
- ``report``: the markdown tables;
- the stages: ``kernels`` (each kernel's device path against its reference), ``gemm_chunks`` (the
  TP overlap's chunked GEMM on one device), ``moe`` (the MoE model against its dense twin, the
  planner beside them; the host waits counted two ways), ``fp8`` (bf16 against FP8),
  ``two_ranks`` (two processes on one device against the serial run), ``tp_overlap`` (two devices),
  ``offload`` (an 8B llama with its optimizer in host memory; ``--only offload``, a call of its own).
"""
