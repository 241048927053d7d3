"""Checks of a whole run configuration against the launch, before any collective.

Pure: every rank runs the same checks on the same inputs and raises the same ConfigError, so a bad
configuration ends the job on every rank with one sentence saying what to change, and no rank is
left waiting in a collective.
"""
from __future__ import annotations

import os

from engine.base import ConfigError
from engine.config.schema import RunConfig
from engine.observe.dashboards import missing_packages
from engine.data.blend import parse_data_path
from engine.data.packing import PackingConfig
from engine.data.tokenizer import strip_data_suffix
from engine.device.runtime import detect_device_type
from models.blocks import takes_attention_inputs
from models.registry import BlockRegistry, default_registry
from parallel.pipeline.partition import partition_layers
from parallel.state import LaunchEnv, LayoutError, check_layout
from parallel.topology import RankGrid


def validate_run(cfg: RunConfig, launch: LaunchEnv,
                 registry: BlockRegistry | None = None) -> tuple[RankGrid, list[str]]:
    """Return the grid and warnings, or raise ConfigError."""
    par, m = cfg.parallel, cfg.model
    try:
        grid = par.grid(launch.world_size)
        notes = check_layout(grid, launch)
    except (LayoutError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    tp = grid.tp
    if grid.cp > 1:
        _validate_cp(cfg, grid)
    for what, value in (("--num-attention-heads", m.num_attention_heads),
                        ("--hidden-size", m.hidden_size), ("--ffn-hidden-size", m.ffn_hidden_size)):
        if value % tp:
            raise ConfigError(f"{what} {value} is not divisible by --tp {tp}; choose a tp that divides it")
    if m.num_query_groups % tp:
        raise ConfigError(f"--num-query-groups {m.num_query_groups} is not divisible by --tp {tp}: "
                          f"tensor parallelism gives every rank whole key/value groups; choose a tp "
                          f"that divides {m.num_query_groups} (or more query groups)")
    if par.sequence_parallel and (m.seq_length // grid.cp) % tp:
        cp = f" / --cp {grid.cp} = {m.seq_length // grid.cp}" if grid.cp > 1 else ""
        raise ConfigError(f"--seq-length {m.seq_length}{cp} is not divisible by --tp {tp}, which "
                          f"--sequence-parallel needs; change one of them")
    if par.sequence_parallel and tp == 1:
        notes.append("--sequence-parallel has no effect with --tp 1")
    chunks = par.chunks_per_rank if grid.pp > 1 else 1
    stages = grid.pp * chunks
    if m.num_layers % stages and not par.stage_end_weight:
        why = " (zb-v holds 2 chunks per rank)" if par.placement == "v" else ""
        raise ConfigError(f"--num-layers {m.num_layers} is not divisible by pp x virtual stages = "
                          f"{grid.pp} x {chunks}{why}; choose a layer count that is a "
                          f"multiple of {stages}, or weight the end stages with --stage-end-weight")
    try:
        partition_layers(m.num_layers, grid.pp, chunks, par.stage_end_weight)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        micro = cfg.data.num_microbatches(grid.dp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if par.pipeline_schedule == "interleaved" and micro % grid.pp:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches per step "
                          f"({micro} = global {cfg.data.global_batch_size} / (micro "
                          f"{cfg.data.micro_batch_size} x dp {grid.dp})) to be a multiple of --pp "
                          f"{grid.pp}; change --global-batch-size or use --pipeline-schedule 1f1b")
    if cfg.data.data_path and not cfg.data.mock_data:
        for _, prefix in parse_data_path(cfg.data.data_path):
            if not _data_exists(prefix):
                raise ConfigError(f"--data-path {prefix}: no prepared data there (expected PREFIX.bin "
                                  f"and PREFIX.idx); run python -m engine.data prepare first")
    try:
        detect_device_type(cfg.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    for flag, path in (("--save", cfg.checkpoint.save), ("--run-dir", cfg.log.run_dir),
                       ("--tensorboard-dir", cfg.log.tensorboard_dir)):
        if path and (problem := unwritable(path)):
            raise ConfigError(f"{flag} {path}: {problem}; choose a directory you can write to")
    for flag, path in (("--metrics-file", cfg.log.metrics_file), ("--timeline", cfg.log.timeline),
                       ("--plot", cfg.log.plot)):
        if path and (problem := unwritable(os.path.dirname(os.path.abspath(path)))):
            raise ConfigError(f"{flag} {path}: {problem}; choose a path you can write to")
    for problem in missing_packages(cfg.log):
        raise ConfigError(problem)
    if cfg.data.mock_data and not m.vocab_size:
        raise ConfigError("--mock-data needs --vocab-size")
    if cfg.checkpoint.load and cfg.checkpoint.load != cfg.checkpoint.save and \
            not os.path.isdir(cfg.checkpoint.load):
        raise ConfigError(f"--load {cfg.checkpoint.load}: no such directory")
    try:
        block_cls = (registry or default_registry()).resolve(m.block)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    d = cfg.data
    needs = "--reset-attention-mask" if d.reset_attention_mask else \
        "--reset-position-ids" if d.reset_position_ids and block_cls.position == "rope" else None
    if needs and not takes_attention_inputs(block_cls):
        raise ConfigError(f"{needs} needs per-token metadata in every block, but --block {m.block} "
                          f"has forward(x) only: define forward(self, x, inputs=None) and pass "
                          f"inputs to ParallelAttention (see models/blocks.py)")
    return grid, notes


def _validate_cp(cfg: RunConfig, grid: RankGrid) -> None:
    """Context parallelism's own rules (cp > 1)."""
    par, m, cp = cfg.parallel, cfg.model, grid.cp
    if par.cp_comm_type == "p2p":
        if m.seq_length % (2 * cp):
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x --cp = {2 * cp}: "
                              f"ring attention gives each rank two of 2*cp equal chunks (load "
                              f"balancing); use a multiple of {2 * cp}")
        if m.dropout > 0:
            raise ConfigError("ring attention (--cp-comm-type p2p) applies no attention dropout: "
                              "use --dropout 0, or --cp-comm-type a2a")
    else:
        if m.seq_length % cp:
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --cp {cp}; use a "
                              f"multiple of {cp}")
        heads = m.num_attention_heads // grid.tp
        if heads % cp:
            raise ConfigError(f"Ulysses attention (--cp-comm-type a2a) splits each TP rank's "
                              f"--num-attention-heads / --tp = {m.num_attention_heads} / {grid.tp} = "
                              f"{heads} heads over --cp {cp} ranks: make heads / tp divisible by "
                              f"cp, or use --cp-comm-type p2p")
    if cfg.compile:
        raise ConfigError("--compile with --cp > 1 is not supported: context-parallel attention "
                          "communicates inside the chunk; drop --compile")


def validate_packing(cfg: RunConfig, eod_id: int | None) -> PackingConfig | None:
    """The run's packed-document switches once the data (and its end-of-document token) is known,
    or None when all are off. Pure, like validate_run: every rank raises the same error."""
    d = cfg.data
    if not (d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss):
        return None
    try:
        return PackingConfig(eod_id, d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _data_exists(path: str) -> bool:
    prefix = strip_data_suffix(path)
    return os.path.exists(prefix + ".bin") and (os.path.exists(prefix + ".idx")
                                                or os.path.exists(prefix + ".json"))


def unwritable(path: str) -> str | None:
    """Why a directory cannot be created or written at ``path`` (None when it can). Looks at the
    nearest existing ancestor; creates nothing."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None
