"""The memory check at start: the planner's estimate of this rank's share of the run against
what the device, and for the offloaded optimizer the host, can still allocate, before anything is
allocated. Pure: every rank runs it on the same inputs and raises the same ConfigError.

- the device: weights, gradients, the optimizer state the device keeps, activations, the pipeline
  ends, communicator buffers (engine/plan/memory.py ``stage_memory``) against the device's free
  memory; on the CPU, where host and device are one memory, the host's parts count here too;
- the host, with ``--optimizer-cpu-offload`` or ``--async-save`` on a device of its own (CUDA,
  NPU): the offloaded masters and moments and the gradients' host copies (engine/plan/offload.py
  ``host_memory``), and the host copy of what the rank saves that ``--async-save`` keeps
  (``async_copy_bytes``), against MemAvailable shared by the node's processes. Where the state
  does not fit it names the offload fractions that fit both memories, if any.
"""
from __future__ import annotations

import math
from dataclasses import replace

from engine.config.schema import RunConfig
from engine.plan.flops import BLOCKS, moe_layer_indices, moe_shape, recompute_stops_early
from engine.plan.memory import (MemoryTerms, optimizer_bytes_per_param, stage_memory,
                                stage_param_split)
from engine.plan.model import Layout, ModelShape
from engine.plan.offload import HostTerms, fraction_within, host_memory
from parallel.dp.policy import CompressionPolicy
from parallel.grid.expert_groups import ExpertGrid
from parallel.grid.topology import RankGrid

NO_FIGURE = (None, "")  # (bytes, where the figure comes from): nothing to check against


def planner_inputs(cfg, grid, vocab_size: int | None = None) -> tuple[ModelShape, Layout] | str:
    """The planner's view of the run (engine/plan/model.py), or why it has none: fused attention
    and recomputation that stops early without a residual dropout, as the engine runs; activation
    and weight bytes from ``--precision``; dropout masks only with ``--dropout`` > 0. ``vocab_size`` replaces the
    configuration's (e.g. a lower bound before the data is read)."""
    m, par = cfg.model, cfg.parallel
    if m.block not in BLOCKS:
        return f"the planner has formulas for {', '.join(BLOCKS)} blocks only (--block {m.block})"
    elem = 4 if cfg.precision.precision == "fp32" else 2
    shape = ModelShape(m.num_layers, m.hidden_size, m.num_attention_heads, vocab_size or m.vocab_size,
                       m.seq_length, cfg.data.global_batch_size, m.ffn_hidden_size, m.block,
                       fused_attention=True, recompute_early_stop=recompute_stops_early(m.dropout),
                       activation_bytes=elem, dropout=m.dropout > 0,
                       attention_dropout=m.attention_dropout_p > 0,
                       num_query_groups=m.num_query_groups, weight_bytes=elem,
                       moe=moe_shape(m), moe_layers=moe_layer_indices(m),
                       fp8_recipe=cfg.precision.fp8_recipe if cfg.precision.fp8_format else None,
                       fp8_bf16_layers=cfg.precision.fp8_bf16_layers,
                       max_positions=m.max_position_embeddings,
                       qk_layernorm=m.qk_layernorm)
    # the planner's schedules: 1f1b (interleaved with vp > 1), zb-h1, zb-v, and for this check
    # GPipe (every micro-batch in flight); 1f1b-w holds what 1F1B holds
    own = par.pipeline_schedule in ("zb-h1", "zb-v", "gpipe") and grid.pp > 1
    policy = CompressionPolicy.coerce(cfg.compression)
    schedule = par.pipeline_schedule if own else "1f1b"
    layout = Layout(grid.tp, grid.pp, grid.dp, par.chunks_per_rank, cfg.data.micro_batch_size,
                    par.recompute, par.use_distributed_optimizer,
                    par.sequence_parallel and grid.tp > 1, grid.cp, par.order,
                    schedule=schedule, zero_stage=par.zero_stage,
                    tp_comm_overlap=par.tp_comm_overlap and par.sequence_parallel and grid.tp > 1,
                    compression=policy.any_compressed,
                    compress_all=policy.default.compressed and all(r.spec.compressed
                                                                   for r in policy.rules),
                    ep=par.expert_model_parallel_size,
                    etp=par.expert_tensor_parallel_size if m.num_experts else 1,
                    offload=(cfg.optim.optimizer_offload_fraction if cfg.optim.optimizer_cpu_offload
                             else 0.0),
                    stage_end_weight=par.stage_end_weight if grid.pp > 1 else 0.0)
    return shape, layout


TERMS = {"weights": ("the weights", "model"), "grads": ("the gradients", "model"),
         "optimizer": ("the optimizer state", "model"), "activations": ("the activations", "batch"),
         "transient": ("recomputation's rebuilt layer", "batch"),
         "pipeline_ends": ("the logits and the embedding's masks", "batch"),
         "comm_buffers": ("the communicator buffers", "groups"),
         "fp8": ("the FP8 copies and scales", "batch"),
         "gathered": ("ZeRO-3's gathered units", "model"),
         "compression": ("gradient compression's residuals", "compression"),
         "host_optimizer": ("the offloaded optimizer state", "offload"),
         "host_grads": ("the gradients' host copies", "offload"),
         "async_copy": ("--async-save's host copy of what it saves", "async")}
ASYNC_COST = "each save then holds training while it is written"
FIXES = {"model": "fewer or narrower layers (--num-layers, --hidden-size, --ffn-hidden-size) or more "
                  "ranks to split them (--tp, --pp; --data-parallel-sharding-strategy optim, "
                  "optim_grads or optim_grads_params shards the optimizer state, the gradients, "
                  "the parameters over dp; --optimizer-cpu-offload moves the optimizer state to "
                  "host memory)",
         "batch": "a smaller --micro-batch-size or --seq-length, --recompute full, or more --tp / "
                  "--pp / --cp",
         "groups": "fewer process groups of more than one rank",
         "compression": "no --grad-compression (its residuals keep 4 bytes per weight, more "
                        "without the distributed optimizer), or more ranks to split the model",
         "offload": "a smaller --optimizer-offload-fraction, or none: on the CPU host memory is the "
                    "device's, so the offload frees nothing",
         "async": f"no --async-save ({ASYNC_COST}), more ranks to split the state (--tp, --pp; "
                  f"the distributed optimizer shards it over dp), or a smaller model"}


def size_text(n: float) -> str:
    """Bytes as KiB ... EiB (three significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} EiB"




def memory_problem(cfg: RunConfig, grid: RankGrid, rank: int, available: int | None, source: str,
                   backend: str, host: tuple[int | None, str] = NO_FIGURE,
                   one_memory: bool = False) -> str | None:
    """Why this rank's share of the run cannot fit (None when it can, or when no estimate or no
    figure exists). ``available``: the bytes the device may still allocate (``source``: where that
    figure comes from); ``host``: (bytes, source) of host memory for the offloaded optimizer;
    ``one_memory``: the device's memory is the host's (the CPU), the offloaded part counts in
    ``available``. Before the data is read the vocabulary counts only when it is given
    (--vocab-size, --mock-data); otherwise as one token, so the estimate is a lower bound and a
    run that fits is never refused."""
    if available is None and host[0] is None:
        return None
    given_vocab = cfg.data.mock_data or "vocab_size" in cfg.explicit
    try:
        planned = planner_inputs(cfg, grid, None if given_vocab else 1)
    except ValueError:  # a layout the planner does not model: no estimate
        return None
    if isinstance(planned, str):
        return None
    shape, layout = planned
    stage = grid.coord(rank).pp
    where = f"rank {rank} (pipeline stage {stage})" if grid.pp > 1 else f"rank {rank}"
    terms: MemoryTerms = stage_memory(shape, layout, stage, backend)
    offloaded = host_memory(shape, layout, *stage_param_split(shape, layout, stage)) \
        if layout.offload else HostTerms()
    parts = {k: v for k, v in terms.as_dict().items() if k in TERMS}
    total = terms.total
    copy = async_copy_bytes(cfg, grid, rank, shape, layout, stage)
    if one_memory:
        parts.update(host_optimizer=offloaded.optimizer, host_grads=offloaded.grads,
                     async_copy=copy)
        total += offloaded.total + copy
    if available is not None and total > available:
        largest = max(parts, key=parts.get)
        what, kind = TERMS[largest]
        return (f"this run needs about {size_text(total)} of memory on {where}, more than the "
                f"{size_text(available)} {source}; the largest part is {what} "
                f"({size_text(parts[largest])}, engine/plan/memory.py's estimate): choose "
                f"{FIXES[kind]}")
    need = HostTerms(offloaded.optimizer, offloaded.grads)
    if one_memory or host[0] is None or need.total + copy <= host[0]:
        return None
    if not layout.offload:
        return (f"--async-save keeps a host copy of what {where} saves, about {size_text(copy)} "
                f"(its weights and optimizer state: engine/training/memory_check.py's estimate), "
                f"more than the {size_text(host[0])} {host[1]}; choose " + FIXES["async"])
    also = f", --async-save's host copy of what it saves {size_text(copy)}" if copy else ""
    return (f"--optimizer-cpu-offload keeps about {size_text(need.total + copy)} in host memory "
            f"for {where} (the offloaded optimizer state {size_text(offloaded.optimizer)}, the "
            f"gradients' host copies {size_text(offloaded.grads)}{also}: engine/plan/offload.py's "
            f"estimate), more than the {size_text(host[0])} {host[1]}; choose "
            + _fitting_fraction(shape, layout, stage, backend, available, host[0], need, copy))


def async_copy_bytes(cfg: RunConfig, grid: RankGrid, rank: int, shape: ModelShape,
                     layout: Layout, stage: int) -> float:
    """Bytes of the host copy that ``--async-save`` (with ``--save``) keeps of what ``rank``
    saves (engine/checkpoint/async_writer.py ``HostBuffers``; 0 without them): its weights where
    it writes them (ZeRO-3: its shards; else the first DP x CP replica, and an expert's first EDP
    replica: engine/checkpoint/specs.py ``first_replica``) and the optimizer state it holds, on
    the device and offloaded alike (all of it under the distributed optimizer, else on the first
    replica): fp32 masters and moments, an fp32 weight's moments alone (it is its own master).
    The same at every offload fraction. Compressed runs' error-feedback residuals are not
    counted."""
    if not (cfg.checkpoint.async_save and cfg.checkpoint.save):
        return 0.0
    dense, expert = stage_param_split(shape, layout, stage)
    c = grid.coord(rank)
    first_dense = c.dp == 0 and c.cp == 0
    first_expert = ExpertGrid(grid, layout.ep).group_of(rank, "edp")[0] == rank
    if layout.zero3:
        weights = dense / (layout.dp * layout.cp) + (expert / layout.edp if expert else 0.0)
    else:
        weights = dense * first_dense + expert * first_expert
    full = replace(layout, offload=0.0)
    state = (dense * optimizer_bytes_per_param(shape, full),
             expert * optimizer_bytes_per_param(shape, full, expert=True) if expert else 0.0)
    if not layout.zero:
        state = (state[0] * first_dense, state[1] * first_expert)
    return shape.weight_bytes * weights + sum(state)


def _fitting_fraction(shape: ModelShape, layout: Layout, stage: int, backend: str,
                      available: int | None, host: int, offloaded: HostTerms,
                      copy: float = 0.0) -> str:
    """The --optimizer-offload-fraction values (in steps of 0.05) whose host part fits ``host``
    and whose device part fits ``available``, or what else to change. Both parts are linear in
    the fraction: the host's grows with it (from ``copy``, --async-save's, the same at every
    fraction), the device's falls."""
    most = fraction_within(host - copy, offloaded.total / layout.offload)   # the host part at 1
    least = 0.0
    if available is not None:
        at = {f: stage_memory(shape, replace(layout, offload=f), stage, backend).total for f in (0.0, 1.0)}
        if at[0.0] > available:
            least = math.ceil(20 * (at[0.0] - available) / (at[0.0] - at[1.0])) / 20 \
                if at[1.0] < at[0.0] else math.inf
    more = ("more data-parallel ranks (with the distributed optimizer each holds 1/dp of the "
            "state) or a smaller model")
    if copy:
        more = f"no --async-save ({ASYNC_COST}), {more}"
    if least > most or most <= 0:
        return more
    if available is None:  # the device's figure unknown: the host's bound alone
        return f"an --optimizer-offload-fraction up to {most:g}, or {more}"
    if least == 0:
        return (f"an --optimizer-offload-fraction up to {most:g}, or no --optimizer-cpu-offload: "
                f"the device holds the whole state")
    if least == most:
        return f"--optimizer-offload-fraction {most:g} (it fits both memories), or {more}"
    return (f"an --optimizer-offload-fraction from {least:g} to {most:g} (both memories "
            f"fit; the smaller, the less the host updates), or {more}")
