"""Parallelism: every way the engine splits a model and its data over ranks.

- grid/: the rank grid, pure arithmetic (``RankGrid``, the expert grid) and the ``ParallelState``
  built from it, the process groups a rank belongs to, and the per-region random streams;
- runtime/: how collectives run: named groups with backend rules and byte counters (``comm``),
  side streams and threads (``streams``, ``lanes``), the stream-order checker, the heartbeat;
- grads/: gradient math shared by the parallel paths: where a gradient lives, the global norm
  and clipping, the zero-bubble weight-gradient store;
- tensor_parallel/, context_parallel/, pipeline/, dp/, expert_parallel/: one folder per
  parallelism, each built on the three above.
"""
