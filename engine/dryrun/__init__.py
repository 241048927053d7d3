"""Dry runs: what every rank of a large job will hold and send, from the code that will run there.

``python -m engine.dryrun --config recipe.yaml --world-size 1024 [--tp 8 --pp 8 ...]`` validates
the configuration as ``engine.train`` does, enumerates the layout's rank roles (roles.py), builds
one rank of each on the meta device under torch's fake process group (build.py), runs one training
step's schedule and records its collectives, memory and activations (record.py), compares every
figure with the planner's (compare.py) and prints and writes them (report.py). docs/planner.md,
"Dry runs", describes what runs and what does not.

    from engine.dryrun import dry_run
    result = dry_run(cfg, world_size=1024, device="h100")
    result.records[0].metrics["param_bytes"], result.records[0].collectives[:3]
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

__all__ = ["DryRun", "dry_run", "prepare"]


@dataclass
class DryRun:
    cfg: object                      # the RunConfig that was built
    grid: object                     # its RankGrid
    records: list                    # record.RoleRecord per role, pipeline order
    rules: str | None                # the backend rules every collective was checked against
    backend: str                     # hccl, nccl or gloo: prices communicator buffers
    num_micro: int
    comparison: list | str           # compare.Row lists per role, or why the planner has none
    device_memory: int | None = None
    usable: int | None = None        # device memory x the planner's usable fraction
    notes: list = field(default_factory=list)
    precision: str = "fp32"          # what was built
    precision_source: str = ""       # why: --precision, or whose default
    tp_comm_overlap: bool = False    # the layers' TP gathers and scatters run as chunk rings
    overlaps: list = field(default_factory=list)  # overlap.OverlapRow lists per role

    def buffers(self, record) -> int:
        from engine.plan.memory import buffer_bytes
        return int(buffer_bytes(record.communicators, record.p2p_peers, self.backend))

    def total(self, record) -> int:
        m = record.metrics
        per_stage = max(record.activation_per_stage.values())
        return (m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"]
                + max(per_stage, record.activation_bytes) + self.buffers(record)
                + record.gathered_bytes)

    def fits(self, record) -> bool:
        return self.usable is None or self.total(record) <= self.usable


def prepare(cfg, world_size: int, devices_per_node: int = 8):
    """(the configuration to build, grid, notes): ``engine.train``'s validation (``validate_run``
    and the compression policy) on a copy of ``cfg`` whose paths (data, checkpoints, logs,
    dashboards) are left out, since they belong to the machine that will run it; raises
    ConfigError for what the run would reject."""
    from engine.base import ConfigError
    from engine.training.validate import validate_run
    from parallel.dp import CompressionPolicy, PolicyError
    from parallel.grid.launch import LaunchEnv
    cfg = copy.deepcopy(cfg)
    notes = []
    if cfg.data.data_path and not cfg.data.mock_data and "vocab_size" not in cfg.explicit:
        notes.append(f"the run takes its vocabulary from --data-path's tokenizer; planned with "
                     f"--vocab-size {cfg.model.vocab_size}: give the tokenizer's size")
    cfg.data.data_path, cfg.device, cfg.compile = None, "auto", False
    cfg.checkpoint.save = cfg.checkpoint.load = None
    for key in ("run_dir", "metrics_file", "timeline", "plot", "tensorboard_dir", "wandb_project",
                "profile_steps"):
        setattr(cfg.log, key, None)
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    launch = LaunchEnv(0, world_size, 0, min(devices_per_node, world_size))
    grid, layout_notes = validate_run(cfg, launch, memory=(None, ""))  # planned for other machines
    from engine.dryrun.assumed import check_supported
    check_supported(cfg)  # MoE: what balanced routing cannot stand in for
    try:
        CompressionPolicy.coerce(cfg.compression)
    except PolicyError as exc:
        raise ConfigError(f"grad_compression_policy: {exc}") from exc
    return cfg, grid, notes + list(layout_notes)


def record_roles(cfg, grid, rules: str | None, devices_per_node: int, registry=None) -> list:
    """One record.RoleRecord per role: each stage's representative first; under ZeRO, where the
    shards of the stage's DP x CP ranks differ in what the fix-up all-reduces sum (roles.py), the
    stage's role is split and every further part is built too."""
    from dataclasses import replace

    from engine.dryrun.record import record_role
    from engine.dryrun.roles import rank_roles, shard_signatures, split_by_shard
    records = []
    for role in rank_roles(cfg, grid):
        rec = record_role(cfg, grid, role, rules, devices_per_node, registry)
        parts = [role] if rec.shard_buckets is None else split_by_shard(
            role, grid, shard_signatures(rec.shard_buckets, grid.dp * grid.cp))
        records.append(replace(rec, role=parts[0]))
        records += [record_role(cfg, grid, part, rules, devices_per_node, registry)
                    for part in parts[1:]]
    return records


def dry_run(cfg, world_size: int, device: str | None = None, memory_gb: float | None = None,
            devices_per_node: int | None = None, registry=None,
            tp_comm_overlap: bool = False) -> DryRun:
    """Validate, build one rank per role, record its step, compare with the planner, and list
    which of its collectives are overlapped with compute (overlap.py).

    ``device``: a planner device name (``engine.plan.hardware``: "a100-80gb", "ascend910b2", ...)
    for the memory check, the backend (hccl for Ascend, else nccl) and its rules, and, under
    ``--fp8-format``, the planner's FP8 check (a chip without an FP8 peak is a ConfigError, the
    planner's line); without it the recipe's ``--device`` decides the backend (npu: hccl, cuda:
    nccl, else gloo).
    ``tp_comm_overlap``: list the layers' TP gathers and scatters as chunk rings (also on when the
    run's configuration has ``tp_comm_overlap`` set)."""
    from engine.dryrun.compare import compare_role
    from engine.dryrun.overlap import role_overlap
    from engine.training.memory_check import planner_inputs
    from engine.base import ConfigError
    from engine.plan.hardware import FP8_FIX_DEVICE, fp8_peak_problem, get_device_spec
    from engine.plan.model import GIB, MEMORY_USABLE_FRACTION, PLAN_PRECISION, backend_of
    from parallel.runtime.backend_rules import resolve
    spec = get_device_spec(device) if device else None
    if spec is not None and cfg.precision.fp8_format and \
            (problem := fp8_peak_problem(spec, fix=FP8_FIX_DEVICE)):
        raise ConfigError(problem)  # the planner's check: the chip the run is planned for
    cfg, source = _precision(cfg, device if spec is not None else None, PLAN_PRECISION)
    per_node = devices_per_node or (spec.devices_per_node if spec else None) or 8
    backend = ({"npu": "hccl", "cuda": "nccl"}.get(cfg.device, "gloo") if spec is None else
               backend_of(spec.name))
    built, grid, notes = prepare(cfg, world_size, per_node)
    rules = resolve(built.parallel.backend_rules, backend, spec.name if spec else "")
    gib = memory_gb if memory_gb is not None else (spec.memory_gb if spec else None)
    records = record_roles(built, grid, rules, per_node, registry)
    planned = planner_inputs(built, grid)
    comparison = planned if isinstance(planned, str) else [
        compare_role(r, built, *planned, backend) for r in records]
    if cfg.data.reset_attention_mask or cfg.data.reset_position_ids:
        notes.append("packed documents: attention ran plain causal (the same collectives and "
                     "buffers; the kernels' document masks are not built)")
    if cfg.compile:
        notes.append("--compile: built uncompiled; a compiled run issues the same collectives")
    ring = bool(getattr(built.parallel, "tp_comm_overlap", False) or tp_comm_overlap)
    num_micro = built.data.num_microbatches(grid.dp)
    overlaps = []
    for r in records:
        rows, note = role_overlap(r, built, grid, ring, num_micro, planned, cfg.compile)
        overlaps.append(rows)
        notes += [note] if note else []
    return DryRun(built, grid, records, rules, backend, num_micro, comparison,
                  None if gib is None else int(gib * GIB),
                  None if gib is None else int(gib * GIB * MEMORY_USABLE_FRACTION), notes,
                  built.precision.precision, source, ring, overlaps)


def _precision(cfg, planner_device: str | None, plan_precision: str):
    """(the configuration to build, why its precision): --precision when given; for a planner
    --device without it, the planner's own default (engine.plan plans mixed precision), so that
    the two tools describe the same run; else engine.train's default."""
    if "precision" in cfg.explicit:
        return cfg, "--precision"
    if planner_device is None:
        return cfg, (f"engine.train's default without --precision; engine.plan plans "
                     f"{plan_precision}: give --precision {plan_precision} to compare with it")
    cfg = copy.deepcopy(cfg)
    cfg.precision.precision = plan_precision
    return cfg, (f"engine.plan's default for --device {planner_device}, so that both tools plan "
                 f"the same run; engine.train's default is fp32: run it with --precision "
                 f"{plan_precision}, as engine.plan's command does, or give --precision here")
