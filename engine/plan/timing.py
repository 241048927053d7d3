"""Step-time model of one layout (the time half of the planner's cost model).

Per layer and micro-batch a device spends: matrix FLOPs / (peak * achievable fraction), memory-bound
bytes / (HBM bandwidth * HBM_EFFICIENCY), the TP collectives over intra-node links and a fixed
per-pass overhead. A pipeline device adds p2p messages (blocking, as Megatron's 1F1B); the first
holds the embedding, the last the logits and loss. The step is then

    m * (slowest device's time per micro-batch)          (includes the stage imbalance)
  + (p - 1) / v * (mean device's time per micro-batch)    (the schedule's bubble)
  + the DP gradient reduction left exposed (bucketed, overlapped with the first stage's last
    backward; at least the last bucket is exposed), plus ZeRO-1's parameter all-gather
  + the optimizer step (memory-bound)

All constants live in engine/plan/model.py and are explained in docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.plan.flops import (attention_core_forward_flops, layer_forward_flops, logits_forward_flops,
                          model_flops_per_step)
from engine.plan.model import (ACT_BYTES, COLLECTIVE_LATENCY_S, EW_MLP, EW_REPLICATED, EW_SCORES,
                               EW_SHARDED_ATTN, GIB, HBM_EFFICIENCY, LAYER_PASS_OVERHEAD_S,
                               MEMORY_USABLE_FRACTION, OPTIMIZER_BYTES_PER_PARAM, Cluster, Layout,
                               ModelShape, memory_per_device, num_micro_batches, stage_params)


def allreduce_s(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    """Ring all-reduce: every rank moves 2 (k-1)/k of the buffer at the bus bandwidth."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (busbw_gbps * 1e9) + COLLECTIVE_LATENCY_S


def gather_or_scatter_s(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    """All-gather or reduce-scatter of a buffer of ``nbytes`` in total: (k-1)/k of it moves."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (busbw_gbps * 1e9) + COLLECTIVE_LATENCY_S


def group_busbw(cluster: Cluster, stride: int, size: int) -> float:
    """Bus bandwidth of a group of ``size`` ranks ``stride`` apart (nodes hold consecutive ranks).

    Inside one node it is the intra-node rate; across nodes a hierarchical ring is limited by the
    NIC shares of the group's members on each node (k members use k shares), capped by NVLink/HCCS.
    """
    dpn = cluster.devices_per_node
    if stride * size <= dpn:
        return cluster.intra_busbw_gbps
    per_node = max(1, min(size, dpn // stride)) if stride < dpn else 1
    return min(cluster.intra_busbw_gbps, per_node * cluster.inter_busbw_gbps)


@dataclass(frozen=True)
class LayerCost:
    fwd_s: float  # one layer, one micro-batch, forward
    bwd_s: float  # backward, including any recomputed forward
    tp_comm_s: float  # the collective part of fwd_s + bwd_s


def layer_cost(shape: ModelShape, cluster: Cluster, layout: Layout) -> LayerCost:
    s, b, h, a = shape.seq_length, layout.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    t, f, rc = layout.tp, shape.ffn_hidden_size, layout.recompute
    rate = cluster.peak_tflops * 1e12 * cluster.achievable_fraction
    hbm = (cluster.device.hbm_gbps or 0) * 1e9 * HBM_EFFICIENCY
    tokens, sbh = s * b, s * b * h
    gemm = layer_forward_flops(tokens, s, h, f, shape.block) / t
    attn = attention_core_forward_flops(tokens, s, h) / t
    scores = 0.0 if shape.fused_attention else EW_SCORES * a * s * s * b / t
    ew = (EW_REPLICATED * sbh / (t if layout.sequence_parallel else 1)
          + (EW_SHARDED_ATTN * sbh + EW_MLP[shape.block] * s * b * f) / t + scores)
    mem_s = (lambda nbytes: nbytes / hbm) if hbm else (lambda nbytes: 0.0)
    # 2 all-reduces forward, 2 backward, 2 more when the forward is recomputed (SP: all-gather +
    # reduce-scatter pairs move the same bytes, with twice the latencies).
    ar = allreduce_s(ACT_BYTES * sbh, t, cluster.intra_busbw_gbps)
    if layout.sequence_parallel:
        ar += COLLECTIVE_LATENCY_S
    n_re = 2 if rc == "full" else 0
    re_gemm = {"full": gemm, "selective": attn, "none": 0.0}[rc]
    re_ew = {"full": ew, "selective": scores, "none": 0.0}[rc]
    passes_bwd = 1 + (rc != "none")
    fwd = gemm / rate + mem_s(ew) + 2 * ar + LAYER_PASS_OVERHEAD_S
    bwd = ((2 * gemm + re_gemm) / rate + mem_s(2 * ew + re_ew) + (2 + n_re) * ar
           + passes_bwd * LAYER_PASS_OVERHEAD_S)
    return LayerCost(fwd, bwd, (4 + n_re) * ar)


def _edge_costs(shape: ModelShape, cluster: Cluster, layout: Layout) -> tuple[float, float, float]:
    """Embedding (first device), logits and loss (last device) per micro-batch, and the p2p time."""
    s, b, h, t, V = shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp, shape.vocab_size
    rate = cluster.peak_tflops * 1e12 * cluster.achievable_fraction
    hbm = (cluster.device.hbm_gbps or 0) * 1e9 * HBM_EFFICIENCY
    mem_s = (lambda nbytes: nbytes / hbm) if hbm else (lambda nbytes: 0.0)
    sbh = s * b * h
    ar = allreduce_s(ACT_BYTES * sbh, t, cluster.intra_busbw_gbps)
    embedding = mem_s(3 * 4 * sbh) + ar  # gather + dropout, forward and backward; vocab-parallel sum
    logits = (3 * logits_forward_flops(s * b, h, V) / t / rate
              + mem_s(20 * s * b * V / t + 3 * 4 * sbh) + ar + 3 * COLLECTIVE_LATENCY_S)
    p2p = 0.0
    if layout.pp > 1:
        crosses = cluster.multi_node and (not cluster.relaxed_placement
                                          or layout.tp * layout.pp > cluster.devices_per_node)
        bw = cluster.inter_busbw_gbps if crosses else cluster.intra_busbw_gbps
        # activations forward and gradients backward, once per model chunk; Megatron's
        # scatter/gather (or SP) sends 1/t of the tensor from each TP rank.
        p2p = 2 * layout.vp * (ACT_BYTES * sbh / t / (bw * 1e9) + COLLECTIVE_LATENCY_S)
    return embedding, logits, p2p


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory_bytes_per_device: float
    fits: bool
    step_time_s: float
    tflops_per_device: float
    mfu: float | None
    parts: dict  # seconds per step: compute (incl. tp_comm), bubble, imbalance, dp_exposed,
    #               zero_allgather, optimizer

    def as_row(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "vp": lay.vp,
                "micro_batch_size": lay.micro_batch_size, "recompute": lay.recompute, "zero": lay.zero,
                "sequence_parallel": lay.sequence_parallel,
                "memory_bytes_per_device": int(self.memory_bytes_per_device),
                "step_time_s": self.step_time_s, "tflops_per_device": self.tflops_per_device,
                "mfu": self.mfu}


def estimate(shape: ModelShape, cluster: Cluster, layout: Layout) -> Estimate:
    """Memory and step time of a layout that obeys check_layout (not re-checked here)."""
    p, v, d, m = layout.pp, layout.vp, layout.dp, num_micro_batches(shape, layout)
    mem = memory_per_device(shape, layout)
    cost = layer_cost(shape, cluster, layout)
    embedding, logits, p2p = _edge_costs(shape, cluster, layout)
    layers = shape.num_layers // p
    body = layers * (cost.fwd_s + cost.bwd_s)
    if p == 1:
        stages = [body + embedding + logits]
    else:
        stages = [body + embedding + p2p, body + logits + p2p] + [body + p2p] * (p - 2)
    slowest, mean = max(stages), sum(stages) / p
    bubble = (p - 1) / v * mean
    pipeline = m * slowest + bubble
    # DP: gradients of the first device (whose last backward ends the step) reduced over dp ranks
    # tp*pp apart; the bucketed reduction hides under that last backward except the final bucket.
    first_params, last_params = stage_params(shape, layout)
    grads = first_params * cluster.grad_reduce_bytes
    bw = group_busbw(cluster, layout.tp * p, d)
    reduce_s = (gather_or_scatter_s if layout.zero else allreduce_s)(grads, d, bw)
    window = layers * cost.bwd_s
    last_bucket = reduce_s * min(1.0, cluster.grad_bucket_bytes / grads)
    dp_exposed = max(reduce_s - window, last_bucket) if d > 1 else 0.0
    allgather = gather_or_scatter_s(first_params * ACT_BYTES, d, bw) if layout.zero else 0.0
    hbm = (cluster.device.hbm_gbps or 0) * 1e9 * HBM_EFFICIENCY
    opt_params = max(first_params, last_params) / (d if layout.zero else 1)
    optimizer = opt_params * OPTIMIZER_BYTES_PER_PARAM / hbm if hbm else 0.0
    step = pipeline + dp_exposed + allgather + optimizer
    flops = model_flops_per_step(shape.global_batch_size, shape.seq_length, shape.num_layers,
                                 shape.hidden_size, shape.vocab_size, shape.ffn_hidden_size,
                                 shape.block, layout.recompute)
    tflops = flops / step / cluster.num_devices / 1e12
    fits = mem.total <= cluster.memory_gb * GIB * MEMORY_USABLE_FRACTION
    parts = {"compute": m * mean, "bubble": bubble, "imbalance": m * (slowest - mean),
             "dp_exposed": dp_exposed, "zero_allgather": allgather, "optimizer": optimizer,
             "tp_comm": m * layers * cost.tp_comm_s}
    return Estimate(layout, mem.total, fits, step, tflops, tflops / cluster.peak_tflops, parts)
