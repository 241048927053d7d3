"""Checks of a whole run configuration against the launch, before any collective.

Pure: every rank runs the same checks on the same inputs and raises the same ConfigError, so a bad
configuration ends the job on every rank with one sentence saying what to change, and no rank is
left waiting in a collective.
"""
from __future__ import annotations

import os

from engine.base import ConfigError, unwritable
from engine.config.schema import PRECISION_DTYPES, RunConfig
from engine.observe.dashboards import missing_packages
from engine.data.blend import parse_data_path
from engine.data.packing import PackingConfig
from engine.data.tokenizer import strip_data_suffix
from engine.device.runtime import BACKENDS, available_memory, detect_device_type
from engine.training.lr_schedule import learning_rate
from engine.training.memory_check import NO_FIGURE, memory_problem
from engine.config.unused_flags import compression_notes, unused_flag_notes
from models.blocks import takes_attention_inputs
from models.registry import BlockRegistry, default_registry
from parallel.pipeline.partition import partition_layers
from parallel.grid.launch import LaunchEnv, LayoutError, check_layout
from parallel.grid.random import StreamGrid, stream_seed
from parallel.grid.topology import RankGrid


def validate_run(cfg: RunConfig, launch: LaunchEnv, registry: BlockRegistry | None = None,
                 memory: tuple[int | None, str] | None = None,
                 host_memory: tuple[int | None, str] | None = None) -> tuple[RankGrid, list[str]]:
    """Return the grid and notes (said once, by rank 0: a warm-up longer than the run, a flag that
    has no effect in this layout: engine/config/unused_flags.py), or raise ConfigError.
    ``memory``: (bytes this rank may allocate, where that figure comes from); by default read
    from the device (engine/device/runtime.py ``available_memory``). ``host_memory``: the same
    for the host, which an offloaded optimizer and --async-save's copies use on a CUDA or NPU
    device; by default the host's MemAvailable shared by the node's processes (none where
    ``memory`` is given)."""
    par, m = cfg.parallel, cfg.model
    try:
        grid = par.grid(launch.world_size)
        notes = check_layout(grid, launch)
        kind = detect_device_type(cfg.device)
        # every dropout stream's seed is derived from --seed (parallel/grid/random.py): refuse one
        # too large for this grid's streams now (the last stream is the largest), not once the
        # process group exists
        streams = StreamGrid(tp=grid.tp, pp=grid.pp, dp=grid.dp, vp=par.chunks_per_rank, cp=grid.cp)
        stream_seed(cfg.seed, "split", streams, tp=grid.tp - 1, pp=grid.pp - 1, dp=grid.dp - 1,
                    chunk=streams.vp - 1, cp=grid.cp - 1)
    except (LayoutError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    wanted = par.distributed_backend
    if wanted not in ("auto", "gloo", BACKENDS[kind]):
        raise ConfigError(f"--distributed-backend {wanted} does not run on a {kind} device (its "
                          f"backend is {BACKENDS[kind]}); use auto, gloo, or the device it needs")
    backend = BACKENDS[kind] if wanted == "auto" else wanted
    tp = grid.tp
    if grid.cp > 1:
        _validate_cp(cfg, grid)
    if cfg.compile and par.recompute != "none" and max(m.dropout, m.attention_dropout_p) > 0:
        raise ConfigError(f"--compile with --recompute {par.recompute} and dropout (--dropout "
                          f"{m.dropout}, --attention-dropout {m.attention_dropout_p}) is not "
                          f"supported: the recomputation replays each dropout mask by restoring "
                          f"the dropout streams' generator states, which a compiled graph cannot "
                          f"do; drop --compile, use --recompute none, or set both dropouts to 0")
    if cfg.compile and max(m.dropout, m.attention_dropout_p) > 0:
        notes.append(f"--compile with dropout (--dropout {m.dropout:g}, --attention-dropout "
                     f"{m.attention_dropout_p:g}): each dropout site breaks the compiled graph (the "
                     f"dropout streams save and restore the generator's state there, which Dynamo "
                     f"does not trace), so a chunk compiles in pieces that nothing fuses across "
                     f"(a 2-layer gpt2 chunk: 10 graphs); set both dropouts to 0 for one graph")
    if cfg.compile and m.num_experts and (loop := _experts_loop(cfg, kind)):
        notes.append(f"--compile with MoE: {loop}, which reads the experts' row counts on the "
                     f"host: the compiled chunk breaks at every expert projection (a 2-layer MoE "
                     f"chunk: 14 graphs over 3 steps where the grouped GEMM gives 1)")
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
    chunks = par.chunks_per_rank if grid.pp > 1 else 1
    stages = grid.pp * chunks
    if m.num_layers % stages and not par.stage_end_weight:
        why = " (zb-v holds 2 chunks per rank)" if par.placement == "v" else ""
        raise ConfigError(f"--num-layers {m.num_layers} is not divisible by pp x virtual stages = "
                          f"{grid.pp} x {chunks}{why}; choose a layer count that is a "
                          f"multiple of {stages}, or weight the end stages with --stage-end-weight")
    try:
        micro = cfg.data.num_microbatches(grid.dp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if par.pipeline_schedule == "interleaved" and micro % grid.pp:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches per step "
                          f"({micro} = global {cfg.data.global_batch_size} / (micro "
                          f"{cfg.data.micro_batch_size} x dp {grid.dp})) to be a multiple of --pp "
                          f"{grid.pp}; change --global-batch-size or use --pipeline-schedule 1f1b")
    try:
        partition_layers(m.num_layers, grid.pp, chunks, par.stage_end_weight)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    # sizes against memory before anything is allocated (the check plans the split above)
    # only gloo lets the node's processes share one device (its memory then divided among them)
    try:  # ValueError: the node's processes cannot each bind a device (device_index)
        available, source = memory or available_memory(kind, launch.local_rank,
                                                       launch.local_world_size, backend=backend)
        if host_memory is None:
            host_memory = NO_FIGURE if memory is not None or kind == "cpu" or not (
                cfg.optim.optimizer_cpu_offload or (cfg.checkpoint.async_save and cfg.checkpoint.save)) \
                else available_memory("cpu", launch.local_rank, launch.local_world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if (problem := memory_problem(cfg, grid, launch.rank, available, source, backend,
                                  host_memory, one_memory=kind == "cpu")):
        raise ConfigError(problem)
    if cfg.data.data_path and not cfg.data.mock_data:
        for _, prefix in parse_data_path(cfg.data.data_path):
            if not _data_exists(prefix):
                raise ConfigError(f"--data-path {prefix}: no prepared data there (expected PREFIX.bin "
                                  f"and PREFIX.idx); run python -m engine.data prepare first")
    check_outputs(cfg)
    if "lr_warmup_iters" in cfg.explicit and cfg.optim.lr_warmup_iters > cfg.optim.train_iters:
        o = cfg.optim
        notes.append(f"--lr-warmup-iters {o.lr_warmup_iters} is longer than the run (--train-iters "
                     f"{o.train_iters}): the learning rate ends at "
                     f"{learning_rate(o.train_iters - 1, o):.3g} and never reaches --lr {o.lr:g}; "
                     f"shorten the warm-up or train longer")
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
    notes += compression_notes(cfg, grid)
    notes += unused_flag_notes(cfg, grid, kind, getattr(block_cls, "position", None) == "rope")
    return grid, notes


def _experts_loop(cfg: RunConfig, kind: str) -> str | None:
    """Why the experts take the per-expert loop (kernels/grouped_gemm.py), or None where one
    grouped GEMM per projection serves them (no host read)."""
    from kernels.grouped_gemm import TORCH_GROUPED_MM_DTYPES
    if not cfg.model.moe_grouped_gemm:
        return "--no-moe-grouped-gemm runs the experts as a loop"
    dtype = PRECISION_DTYPES[cfg.precision.precision]
    if kind in TORCH_GROUPED_MM_DTYPES and dtype not in TORCH_GROUPED_MM_DTYPES[kind]:
        takes = ", ".join(str(d).removeprefix("torch.") for d in TORCH_GROUPED_MM_DTYPES[kind])
        return (f"torch._grouped_mm takes {takes} on {kind}, not --precision "
                f"{cfg.precision.precision}: the experts run as a loop")
    return None


def output_paths(cfg: RunConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(directories, files) the run writes, as (flag, path) pairs."""
    log, ck = cfg.log, cfg.checkpoint
    dirs = [("--save", ck.save), ("--run-dir", log.run_dir), ("--tensorboard-dir", log.tensorboard_dir)]
    if log.profile_steps:
        dirs.append(("--profile-dir", log.profile_dir))
    if log.wandb_project and log.wandb_mode != "disabled":
        dirs.append(("--wandb-save-dir", log.wandb_save_dir))
    files = [("--metrics-file", log.metrics_file), ("--timeline", log.timeline), ("--plot", log.plot)]
    return [(f, p) for f, p in dirs if p], [(f, p) for f, p in files if p]


def check_outputs(cfg: RunConfig) -> None:
    """Every output path can be written and is of the right kind (a directory, or a file that is
    not a directory), and no two outputs are one file; creates nothing."""
    dirs, files = output_paths(cfg)
    for flag, path in dirs:
        if (problem := unwritable(path)):
            raise ConfigError(f"{flag} {path}: {problem}; choose a directory you can write to")
    for flag, path in files:
        if os.path.isdir(path):
            raise ConfigError(f"{flag} {path} is a directory; give a file name (e.g. "
                              f"{os.path.join(path, os.path.basename(RUN_DIR_NAMES[flag]))})")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path} is not writable; choose a path you can write to")
        if (problem := unwritable(os.path.dirname(os.path.abspath(path)))):
            raise ConfigError(f"{flag} {path}: {problem}; choose a path you can write to")
    seen: dict[str, str] = {}
    for flag, path in files:
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"{seen[real]} and {flag} are both {path}: each output needs a file "
                              f"of its own")
        seen[real] = flag


RUN_DIR_NAMES = {"--metrics-file": "metrics.jsonl", "--timeline": "timeline.json", "--plot": "loss.png"}


def _validate_cp(cfg: RunConfig, grid: RankGrid) -> None:
    """Context parallelism's own rules (cp > 1)."""
    par, m, cp = cfg.parallel, cfg.model, grid.cp
    if par.cp_comm_type == "p2p":
        if m.seq_length % (2 * cp):
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x --cp = {2 * cp}: "
                              f"ring attention gives each rank two of 2*cp equal chunks (load "
                              f"balancing); use a multiple of {2 * cp}")
        if m.attention_dropout_p > 0:
            given = "--attention-dropout" if m.attention_dropout is not None else \
                "--dropout (which also sets --attention-dropout)"
            raise ConfigError(f"ring attention (--cp-comm-type p2p) applies no attention dropout, "
                              f"but {given} is {m.attention_dropout_p}: use --attention-dropout 0 "
                              f"(--dropout may stay, for the residual branches), or --cp-comm-type a2a")
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


