"""What a run is and everything around it, by subsystem (docs/design.md, "Layout").

Lowest first; each package imports only those above it in this list (tests/test_layout.py):

- ``base``: shared exceptions and small types (``ConfigError``, ``FieldInfo``); imports nothing;
- ``device/``: the accelerator (npu, cuda, cpu): binding, chips, device clocks, torch.compile;
- ``data/``: tokenizers, Megatron's indexed format, blends, splits, samplers, the built-in corpus;
- ``plan/``: the cluster planner (FLOPs, memory, traffic, step time, hardware table);
- ``config/``: the typed run configuration, its flags, YAML recipes and the command line;
- ``checkpoint/``: sharded, resharding checkpoints, Hugging Face import and export;
- ``observe/``: metrics, dashboards, utilization, profiling, anomaly and straggler detection,
  fault injection;
- ``training/``: the loop (launch, trainer, step, step record, LR schedule, loss scaler, start-up
  checks); ``tools/``: cluster preflight, collective benchmark, text generation (beside the loop,
  neither imports the other);
- ``dryrun/``: large layouts on the meta device, built by the training code.

The modules left at this level are the entry points users type: ``python -m engine.train``,
``engine.generate``, ``engine.preflight``, ``engine.export``, ``engine.import_hf`` (and the
packages ``engine.plan``, ``engine.dryrun``, ``engine.data``, ``engine.checkpoint``); each is a few
lines that call into its package.
"""
