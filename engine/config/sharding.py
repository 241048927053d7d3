"""Data-parallel sharding: Megatron-LM's ``--data-parallel-sharding-strategy`` and its aliases, and
the optimizer offload's flags against the rest of the run (pure; called by parallel.py and
schema.py).

    no_shard            ZeRO-0: the plain optimizer, every rank holds everything
    optim               ZeRO-1: optimizer state sharded     (= --use-distributed-optimizer)
    optim_grads         ZeRO-2: and the fp32 gradients      (= --use-distributed-optimizer --zero-stage 2)
    optim_grads_params  ZeRO-3: and the parameters          (= --use-distributed-optimizer --zero-stage 3)

After ``resolve_sharding`` the three fields agree: ``use_distributed_optimizer`` is True from
``optim`` on and ``zero_stage`` is the stage (1 under ``no_shard``, its old default), so code that
reads either sees the strategy.
"""
from __future__ import annotations

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
STAGE = {name: stage for stage, name in enumerate(STRATEGIES)}


def resolve_sharding(par) -> None:
    """Set ``par.data_parallel_sharding_strategy``, ``use_distributed_optimizer`` and
    ``zero_stage`` (a ParallelConfig) to one meaning, or raise ValueError naming the flags that
    contradict each other."""
    strategy, zero, stage = par.data_parallel_sharding_strategy, par.use_distributed_optimizer, \
        par.zero_stage
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"--data-parallel-sharding-strategy must be one of {STRATEGIES}, got "
                         f"{strategy!r}")
    if stage is not None and stage not in (1, 2, 3):
        raise ValueError(f"--zero-stage must be 1, 2 or 3, got {stage} (stage 0 is the default "
                         f"optimizer: leave out --use-distributed-optimizer)")
    if strategy is None:
        if stage is not None and stage > 1 and not zero:
            raise ValueError(f"--zero-stage {stage} shards the distributed optimizer's "
                             f"{'gradients' if stage == 2 else 'gradients and parameters'}: add "
                             f"--use-distributed-optimizer")
        strategy = STRATEGIES[(stage or 1) if zero else 0]
    elif strategy == "no_shard" and zero:
        raise ValueError("--data-parallel-sharding-strategy no_shard contradicts "
                         "--use-distributed-optimizer (which is optim); give one of them")
    elif stage is not None and stage != max(STAGE[strategy], 1):
        raise ValueError(f"--data-parallel-sharding-strategy {strategy} is ZeRO-{STAGE[strategy]}, "
                         f"which contradicts --zero-stage {stage}; give one of them")
    par.data_parallel_sharding_strategy = strategy
    par.use_distributed_optimizer = STAGE[strategy] > 0
    par.zero_stage = max(STAGE[strategy], 1)


def check_sharding_flags(cfg) -> None:
    """What ZeRO-3 and the optimizer offload cannot run with (a RunConfig): one line each."""
    par, optim = cfg.parallel, cfg.optim
    if not 0.0 < optim.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be in (0, 1], got "
                         f"{optim.optimizer_offload_fraction}")
    compression = cfg.compression.grad_compression != "none" or \
        bool(cfg.compression.grad_compression_policy)
    if par.zero_stage == 3 and par.use_distributed_optimizer:
        if cfg.compile:
            raise ValueError("--data-parallel-sharding-strategy optim_grads_params with --compile "
                             "is not built: each block's parameters are gathered and freed by "
                             "hooks around it, which a compiled graph would trace; drop "
                             "--compile or use optim_grads")
        if compression:
            raise ValueError("gradient compression with --data-parallel-sharding-strategy "
                             "optim_grads_params is not built; drop --grad-compression (and "
                             "grad_compression_policy) or use optim_grads")
    if optim.optimizer_cpu_offload:
        if not par.use_distributed_optimizer:
            raise ValueError("--optimizer-cpu-offload moves the distributed optimizer's state to "
                             "host memory: add --use-distributed-optimizer (or "
                             "--data-parallel-sharding-strategy optim, optim_grads or "
                             "optim_grads_params)")
        sparse = {"topk", "onebit"}
        policy = cfg.compression.grad_compression_policy or {}
        kinds = {cfg.compression.grad_compression} | _policy_kinds(policy)
        if kinds & sparse:
            raise ValueError(f"--optimizer-cpu-offload with --grad-compression "
                             f"{sorted(kinds & sparse)[0]} is not built (its frozen-variance update "
                             f"runs on the device); use int8 or drop one of them")


def _policy_kinds(policy) -> set[str]:
    """The compressors a per-branch policy names (default and rules), as given."""
    if not isinstance(policy, dict):
        return set()
    kinds = set()
    for rule in [policy.get("default"), *policy.get("rules", [])]:
        if isinstance(rule, str):
            kinds.add(rule)
        elif isinstance(rule, dict) and isinstance(rule.get("compressor"), str):
            kinds.add(rule["compressor"])
    return kinds
