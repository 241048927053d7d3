"""What the planner prints: ``--explain``'s term-by-term breakdown and the launch command.

``launch_command`` writes the ``torchrun ... -m engine.train`` line of a layout with this engine's
flag names (engine/config/cli.py: the config fields with dashes); tests/engine/plan/test_plan.py parses it back with
torchrun's own parser and ``engine.config.cli.parse_args`` and compares the result with the layout.
"""
from __future__ import annotations

import shlex

from engine.plan.model import GIB, Layout, ModelShape
from engine.plan.placement import (DEFAULT_ORDER, engine_order, expert_groups_of_rank0,
                                   group_of_rank0, members_per_node)
from engine.plan.timing import Estimate

MASTER_ENDPOINT = "$MASTER_ADDR:29500"  # left for the shell of every node to expand
# engine.train's --data-parallel-sharding-strategy of each ZeRO stage (Megatron-LM's names)
SHARDING = {1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def schedule_of(layout: Layout) -> str:
    return layout.pipeline_schedule


def train_args(shape: ModelShape, layout: Layout, precision: str = "bf16",
               data_path: str | None = None) -> list[str]:
    """``python -m engine.train`` arguments that run ``layout`` on ``shape``.

    Without ``data_path`` the run uses mock data of the planned vocabulary (the built-in corpus has
    its own, smaller vocabulary). ``--order`` only appears when it differs from the engine's
    default; ``--cp`` only for cp > 1; the pipeline's flags only for pp > 1: engine.train notes
    no flag of this command as having no effect (tests/engine/plan/test_plan_train_check.py).
    """
    args = ["--tp", str(layout.tp), "--pp", str(layout.pp)]
    if layout.cp > 1:
        args += ["--cp", str(layout.cp)]
    if shape.moe is not None:
        args += ["--ep", str(layout.ep)]
        if layout.etp > 1:
            args += ["--etp", str(layout.etp)]
    if layout.pp > 1:  # engine.train notes them as having no effect without a pipeline
        args += ["--virtual-pipeline-size", str(layout.vp),
                 "--pipeline-schedule", schedule_of(layout)]
    args += ["--micro-batch-size", str(layout.micro_batch_size),
             "--global-batch-size", str(shape.global_batch_size), "--recompute", layout.recompute]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    if layout.zero:
        args += ["--data-parallel-sharding-strategy", SHARDING[layout.zero_stage]]
    if layout.offload:
        args.append("--optimizer-cpu-offload")
        if layout.offload < 1:
            args += ["--optimizer-offload-fraction", f"{layout.offload:g}"]
    if layout.tp_comm_overlap and layout.sequence_parallel:
        args.append("--tp-comm-overlap")
    if not layout.overlap_grad_reduce and layout.dp * layout.cp > 1:
        args.append("--no-overlap-grad-reduce")
    if layout.zero and not layout.overlap_param_gather:
        args.append("--no-overlap-param-gather")
    order = engine_order(layout.order, layout.cp)
    if order != engine_order(DEFAULT_ORDER, layout.cp):
        args += ["--order", order]
    args += ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
             "--num-attention-heads", str(shape.num_attention_heads),
             "--ffn-hidden-size", str(shape.ffn_hidden_size), "--seq-length", str(shape.seq_length),
             "--vocab-size", str(shape.vocab_size), "--block", shape.block, "--precision", precision]
    if shape.num_query_groups not in (None, shape.num_attention_heads):
        args += ["--num-query-groups", str(shape.num_query_groups)]
    args += moe_args(shape)
    args += ["--data-path", data_path] if data_path else ["--mock-data"]
    return args


def moe_args(shape: ModelShape) -> list[str]:
    """engine.train's MoE flags for ``shape`` (none for a dense model): experts, top-k, widths
    and which layers (``--moe-layer-freq`` as a 0/1 list unless every layer is one)."""
    moe = shape.moe
    if moe is None:
        return []
    args = ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.topk),
            "--moe-ffn-hidden-size", str(moe.ffn_hidden)]
    if moe.shared_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn)]
    if moe.layers != shape.num_layers:
        flags = ",".join("1" if shape.is_moe(i) else "0" for i in range(shape.num_layers))
        args += ["--moe-layer-freq", f"[{flags}]"]
    return args


def layout_text(layout: Layout) -> str:
    """``tp=.. cp=.. pp=.. dp=.. ep=.. [etp=..] vp=.. mbs=.. recompute=.. zero=.. sp=..
    [offload=..]``: every layout line (``etp=`` when expert tensor parallelism is on, etp = tp;
    ``zero=`` off or the ZeRO stage; ``offload=`` the optimizer's fraction in host memory)."""
    etp = f"etp={layout.etp} " if layout.etp > 1 else ""
    offload = f" offload={layout.offload:g}" if layout.offload else ""
    return (f"tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp} ep={layout.ep} {etp}"
            f"vp={layout.vp} mbs={layout.micro_batch_size} recompute={layout.recompute} "
            f"zero={layout.zero_stage if layout.zero else 'off'} "
            f"sp={'on' if layout.sequence_parallel else 'off'}{offload}")


def launch_command(shape: ModelShape, layout: Layout, devices_per_node: int, precision: str = "bf16",
                   data_path: str | None = None, model_flags: tuple[str, ...] = ()) -> str:
    """The torchrun line to run on every node (one node: no rendezvous endpoint needed);
    ``model_flags``: the user's model flags the shape does not carry (``--qk-layernorm``, ...)."""
    world = layout.world_size
    nodes = max(1, world // devices_per_node)
    per_node = min(world, devices_per_node)
    head = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node)]
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f'"{MASTER_ENDPOINT}"'] if nodes > 1 else []
    tail = [shlex.quote(a) for a in [*train_args(shape, layout, precision, data_path), *model_flags]]
    return " ".join(head + rdzv + ["-m", "engine.train"] + tail)


def _seconds(x: float) -> str:
    return f"{x * 1e3:10.2f} ms" if x < 1 else f"{x:10.3f} s "


def _link_line(est: Estimate, devices_per_node: int) -> str:
    lay = est.layout
    parts = []
    for dim, gbps in (("tp", est.links.tp), ("cp", est.links.cp), ("pp", est.links.pp),
                      ("dp", est.links.dp)):
        dims = ("cp", "dp") if dim == "dp" else (dim,)
        ranks = group_of_rank0(lay.order, lay.sizes, dims)
        if len(ranks) == 1:
            continue
        nodes = members_per_node(ranks, devices_per_node)
        where = "1 node" if len(nodes) == 1 else f"{len(nodes)} nodes x {min(nodes.values())}"
        name = "dp x cp" if dim == "dp" and lay.cp > 1 else dim
        parts.append(f"{name} {ranks[:4]}{'...' if len(ranks) > 4 else ''} ({where}, {gbps:.0f} GB/s)")
    if lay.ep > 1:
        ep_ranks, edp_ranks = expert_groups_of_rank0(lay.order, lay.sizes, lay.ep)
        for name, ranks in (("ep", ep_ranks), ("edp", edp_ranks)):
            if len(ranks) == 1:
                continue
            nodes = members_per_node(ranks, devices_per_node)
            where = "1 node" if len(nodes) == 1 else f"{len(nodes)} nodes x {min(nodes.values())}"
            rate = f", {est.links.edp:.0f} GB/s" if name == "edp" else ""
            parts.append(f"{name} {ranks[:4]}{'...' if len(ranks) > 4 else ''} ({where}{rate})")
    return "  groups of rank 0: " + ("; ".join(parts) if parts else "none (one device)")


def _cp_note(est: Estimate) -> str:
    """What cp_comm is: the exposed part of the ring exchange, the rest hidden under attention."""
    if est.layout.cp == 1:
        return "  (no context parallelism)"
    ring = est.cp_ring_s
    hidden = max(0.0, ring - est.time.cp_comm)
    return (f"  exposed part of a {_seconds(ring).strip()} ring exchange; "
            f"{_seconds(hidden).strip()} of it hidden under the attention blocks")


def _hidden_note(est: Estimate, name: str) -> str:
    """What a communication term is: the exposed part, and how much of it is hidden, under what."""
    lay, hidden = est.layout, est.hidden.get(name, 0.0)
    shown = _seconds(hidden).strip()
    if name == "tp_comm":
        if lay.tp == 1:
            return "  (no tensor parallelism)"
        if lay.tp_comm_overlap and lay.sequence_parallel:
            return f"  exposed; {shown} hidden under the GEMMs (--tp-comm-overlap: tp-chunk rings)"
        why = "needs sequence parallelism" if lay.tp_comm_overlap else "no --tp-comm-overlap"
        return f"  exposed; {shown} hidden ({why})"
    if name == "pp_comm":
        return "  (no pipeline)" if lay.pp == 1 else f"  exposed; {shown} hidden (blocking transfers)"
    if name == "ep_comm":
        if lay.ep == 1:
            return "  (no expert parallelism)"
        return "  exposed: the MoE dispatch and combine collectives (not overlapped)" + (
            f"; etp {lay.etp}: the experts' TP all-reduces are in tp_comm" if lay.etp > 1 else "")
    if name == "dp_comm":
        if lay.dp * lay.cp == 1:
            return "  (no data parallelism)"
        if not lay.overlap_grad_reduce:
            return f"  exposed; {shown} hidden (--overlap-grad-reduce off: after backward)"
        return f"  exposed; {shown} hidden under the last backward (per bucket, last bucket exposed)"
    if name == "zero_allgather":
        if not lay.zero:
            return "  (no ZeRO)"
        if lay.zero3:
            how = ("each unit's gathered when it starts" if not lay.overlap_param_gather else
                   "each unit prefetched under the one before it, forward and backward")
            return f"  exposed; {shown} hidden (ZeRO-3: {how})"
        if not lay.overlap_param_gather:
            return f"  exposed; {shown} hidden (--overlap-param-gather off: after the update)"
        return f"  exposed; {shown} hidden ahead of the next forward (per bucket, first bucket exposed)"
    if name == "offload_copy":
        if not lay.offload:
            return "  (no optimizer offload)"
        return (f"  exposed; {shown} hidden (gradients down under the last backward, weights up "
                f"beside the host update)")
    if name == "host_update":
        return "  (no optimizer offload)" if not lay.offload else "  the host's AdamW, exposed"
    return ""


def _overlap_line(est: Estimate) -> str:
    lay, eff = est.layout, est.efficiency
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    line = (f"  overlaps: tp-comm-overlap {on(lay.tp_comm_overlap and lay.sequence_parallel)}, "
            f"grad reduce {on(lay.overlap_grad_reduce)}, param gather {on(lay.overlap_param_gather)}")
    if eff is not None:
        line += f"; efficiency tp {eff.tp:.2f}, dp {eff.dp:.2f}, zero {eff.zero:.2f}"
    return line


def explain(est: Estimate, devices_per_node: int) -> str:
    """Every term of the estimate: step time by term, memory by part, FLOPs and rates."""
    lay, t, mem = est.layout, est.time, est.memory
    lines = [f"layout {layout_text(lay)} order={lay.order}",
             _link_line(est, devices_per_node), _overlap_line(est),
             f"step time {_seconds(t.total).strip()}"]
    for name, value in t.as_dict().items():
        if name != "total":
            lines.append(f"  {name:<16}{_seconds(value)}  {100 * value / t.total:5.1f}%"
                         + (_cp_note(est) if name == "cp_comm" else _hidden_note(est, name)))
    lines.append(f"memory per device ({mem.stage} stage) {mem.total / GIB:.2f} GiB "
                 f"({'fits' if est.fits else 'does NOT fit'})")
    for name, value in mem.as_dict().items():
        if name not in ("total", "stage"):
            lines.append(f"  {name:<16}{value / GIB:10.2f} GiB")
    if lay.offload:
        host = est.host
        lines.append(f"host memory per device (offload {lay.offload:g}) {host.total / GIB:.2f} GiB: "
                     f"optimizer {host.optimizer / GIB:.2f} GiB, gradient copies "
                     f"{host.grads / GIB:.2f} GiB")
    pad = est.flops.vocab_padding   # the output layer's padded vocabulary columns (flops.py)
    lines.append(f"FLOPs per step: model {est.flops.model:.4g}, executed {est.flops.executed:.4g} "
                 f"(recompute {est.flops.recomputed:.4g}"
                 + (f", padded vocabulary {pad:.4g})" if pad else ")"))
    lines.append(f"TFLOP/s per device: model {est.model_tflops_per_device:.1f} (MFU "
                 f"{100 * est.mfu:.1f}%), executed {est.tflops_per_device:.1f} (HFU {100 * est.hfu:.1f}%) "
                 f"of {est.peak_tflops:g} peak")
    return "\n".join(lines)
