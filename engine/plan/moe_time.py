"""One MoE layer's time per micro-batch, as it changes a dense layer's (timing.py adds it to the
layers of each stage): ``moe_layer_change``. Besides the GEMMs, the permutation's memory-bound
copies and the all-to-alls, it holds what the engine adds (``moe_engine_time``):

- launches: the routing, counting, permutation and combine kernels, ``cluster.moe_pass_overhead_s``
  per forward or backward pass and per recomputed forward (model.MOE_PASS_OVERHEAD_S unless
  ``--calibrate`` fitted it to a measured MoE run, calibrate_moe.py);
- host waits: under EP the split sizes' one read per MoE layer and forward (models/moe/layer.py,
  parallel/expert_parallel/host_read.py), ``HOST_WAIT_S`` of device idle each; none at ep = 1,
  where the layer reads nothing on the host;
- load imbalance: under EP the busiest EP rank computes and receives ``moe_load_imbalance`` times
  the balanced rows (the run's max over mean expert load, 1 when balanced), and its EP peers wait
  for it at the next all-to-all: (imbalance - 1) x (its experts' GEMMs and the all-to-alls). The
  expert-level figure is taken for the rank's: exact when each rank holds one expert, an upper
  bound when it holds several. At ep = 1 one device computes every row whatever the imbalance.

The allgather dispatcher (``MoEShape.dispatcher``, moe_allgather.py) replaces the all-to-alls by
its gathers and reduce-scatters over the EP group's bus bandwidth, exposed as well; their size
does not follow the load (the imbalance adds the busiest rank's experts only), and padded to
capacity it reads nothing on the host (no wait).
"""
from __future__ import annotations

from engine.plan import moe_allgather
from engine.plan.collectives import allreduce_s, alltoall_s, gather_or_scatter_s
from engine.plan.fp8 import linear_rate
from engine.plan.model import (ACT_BYTES, COLLECTIVE_LATENCY_S, EW_MLP, EW_MOE_PERMUTE, EW_MOE_RESORT,
                               HOST_WAIT_S, Cluster, Layout, ModelShape, moe_expert_rows, moe_tokens)
from engine.plan.passes import Links, PassTime, _rates
from engine.plan.placement import collective_busbw


def moe_engine_time(cluster: Cluster, layout: Layout, experts_s: float,
                    alltoall_s: float, reads: bool = True) -> tuple[float, float]:
    """(launches and host waits, load imbalance) of one MoE layer and micro-batch, seconds.
    ``experts_s``: the experts' GEMMs (forward, backward and any recomputation) on one rank;
    ``alltoall_s``: its dispatch and combine all-to-alls (the collectives whose size follows the
    load); ``reads``: whether the layer reads its row counts on the host under EP."""
    forwards = 2 if layout.recompute == "full" else 1
    launches = (forwards + 1) * cluster.moe_pass_overhead_s
    waits = forwards * HOST_WAIT_S if layout.ep > 1 and reads else 0.0
    imbalance = 0.0
    if layout.ep > 1:
        imbalance = (cluster.moe_load_imbalance - 1.0) * (experts_s + alltoall_s)
    return launches + waits, imbalance


def moe_layer_change(shape: ModelShape, cluster: Cluster, layout: Layout, links: Links) -> PassTime:
    """What one MoE layer adds to (or saves on) ``layer_time`` per micro-batch: its MLP's
    matrices are the router (h x E, whole on every TP rank) and K experts (whole on every TP rank
    with ETP = 1; with ETP = tp each TP rank runs 1/tp of every expert), and the shared expert
    split by TP, instead of the dense MLP split by TP; the permutation's memory-bound passes
    (``EW_MOE_PERMUTE`` x T K h, every TP rank permuting the same rows); the all-to-alls of the
    T K rows over the EP group, dispatch and combine each way (traffic.py), exposed (the allgather
    dispatcher: its gathers and reduce-scatters, moe_allgather.py). TP: without a
    shared expert the dense MLP's TP collectives are gone; with ETP = tp the combined (T, h)
    output is all-reduced over TP forward, the tokens' and router weights' gradients backward
    (traffic.moe_tp_per_layer). Zero without MoE layers."""
    moe = shape.moe
    if moe is None:
        return PassTime()
    from engine.plan.flops import _MLP_MATRICES
    s, b, h, t = shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp
    etp, sp = layout.etp, layout.sequence_parallel
    rate, mem_s = _rates(cluster)
    tokens, routed = s * b / layout.cp, moe_tokens(shape, layout)  # routed: this TP rank's
    # the experts' rows: T K of the TP group's tokens under ETP with SP, E C padded to capacity
    rows = moe_expert_rows(shape, layout)
    n = _MLP_MATRICES[shape.block]
    # every TP rank: the router whole, the experts whole (ETP 1) or their 1/etp slices
    router = 2 * h * routed * moe.num_experts
    expert = 2 * h * rows * n * moe.ffn_hidden / etp
    shared = 2 * tokens * h * n * (moe.shared_ffn - shape.ffn_hidden_size) / t   # TP linears
    fp8_rate = linear_rate(cluster, shape)   # the experts' grouped GEMMs are FP8 under FP8 too
    gemm_s = router / rate + (expert + shared) / fp8_rate
    copies = EW_MOE_PERMUTE + (EW_MOE_RESORT if layout.ep > 1 else 0)  # the permutation's passes
    ew = (EW_MLP[shape.block] * (rows * moe.ffn_hidden / etp
                                 + tokens * (moe.shared_ffn - shape.ffn_hidden_size) / t)
          + copies * rows * h)
    fwd, bwd = gemm_s + mem_s(ew), 2 * gemm_s + mem_s(2 * ew)
    full = layout.recompute == "full"
    redo = (gemm_s + mem_s(ew)) if full else 0.0
    if full and shape.recompute_early_stop:  # the skipped down projection: the shared expert's
        redo -= shared / n / fp8_rate
    gathered = moe.dispatcher == "allgather"
    if gathered:   # every EP rank's tokens gathered, the combine reduce-scattered (moe_allgather.py)
        ep_fwd, ep_bwd, ep_re = moe_allgather.seconds(shape, layout, collective_busbw(
            links.ep, cluster.devices_per_node, cluster.intra_busbw_gbps, cluster.inter_busbw_gbps))
    else:
        one = 0.0
        if layout.ep > 1:
            one = alltoall_s(shape.activation_bytes * rows * h, links.ep, cluster.devices_per_node,
                             cluster.intra_busbw_gbps, cluster.inter_busbw_gbps)
        # the forward's count exchange, a few bytes (none padded to capacity)
        counts = COLLECTIVE_LATENCY_S if one and not moe.padded_capacity_factor else 0.0
        ep_fwd, ep_bwd = 2 * one + counts, 2 * one
        ep_re = ep_fwd if full else 0.0
    # TP (layer_time's convention: no SP all-reduces, SP gathers and scatters; the --tp-comm-overlap
    # rings are left as the dense layer's)
    tp_fwd = tp_bwd = tp_re = 0.0
    if t > 1:
        msg = ACT_BYTES * tokens * h
        if not moe.shared_ffn and not (sp and layout.tp_comm_overlap):  # no MLP collectives
            unit = (gather_or_scatter_s if sp else allreduce_s)(msg, t, links.tp)
            tp_fwd, tp_bwd = (-2 * unit, -3 * unit) if sp else (-unit, -unit)
            tp_re = -unit if sp and full else 0.0
        if etp > 1 and not sp:  # the experts' partial outputs summed over TP
            reduce = allreduce_s(msg, t, links.tp)
            tp_fwd += reduce
            tp_bwd += reduce + allreduce_s(4 * tokens * moe.topk, t, links.tp)
            tp_re += reduce if full and moe.shared_ffn else 0.0
        elif etp > 1:  # SP: the shards gathered in, the output reduce-scattered out
            move = gather_or_scatter_s(msg, t, links.tp)
            small = gather_or_scatter_s(12 * tokens * moe.topk, t, links.tp)  # weights, experts
            tp_fwd += 2 * move + small
            tp_bwd += 2 * move + gather_or_scatter_s(4 * tokens * moe.topk, t, links.tp)
            tp_re += (move + small + (move if moe.shared_ffn else 0.0)) if full else 0.0
    experts = expert / fp8_rate  # their forward GEMMs
    # the allgather dispatcher's collectives are as large whatever the load, and padded to
    # capacity it reads nothing on the host
    overhead, imbalance = moe_engine_time(cluster, layout, experts * (4 if full else 3),
                                          0.0 if gathered else ep_fwd + ep_bwd + ep_re,
                                          reads=not (gathered and moe.padded_capacity_factor))
    return PassTime(compute=fwd + bwd, recompute=redo, tp_comm=tp_fwd + tp_bwd + tp_re,
                    backward=bwd + redo + ep_bwd + ep_re + tp_bwd + tp_re,
                    weight=gemm_s, ep_comm=ep_fwd + ep_bwd + ep_re,
                    moe_overhead=overhead, moe_imbalance=imbalance)
