"""Step-time model of one layout, as named terms that add up to the step.

Per layer and micro-batch a device spends: matrix FLOPs / (peak * achievable fraction), memory-bound
bytes / (HBM bandwidth * HBM_EFFICIENCY), a fixed per-pass overhead, the TP collectives over its
node's links (with ``--tp-comm-overlap`` the part of each layer's chunk rings that its GEMMs do not
hide, overlap.py) and, with context parallelism, the part of the K/V ring exchange that the attention
core does not hide (hop by hop; the last dK/dV hop is always exposed). A pipeline device adds p2p messages (blocking, as the engine's 1F1B) and the
TP all-gather that rebuilds a received activation; the first holds the embedding, the last the
logits and loss (over the vocabulary padded to a multiple of 128 x tp, as the engine computes it;
the executed FLOPs count those columns, the model FLOPs do not: flops.py). The step is then

    m * (mean device's time per micro-batch)              compute, recompute, tp/cp/pp comm
  + m * (slowest - mean device's time per micro-batch)    imbalance
  + the schedule's bubble: (p - 1) / v micro-batches of the mean device for 1F1B and
    interleaved; for the zero-bubble schedules from the mean device's forward, input-gradient (B)
    and weight-gradient (W) times, ``pipeline_bubble_s``
  + the DP gradient reduction left exposed (bucketed, overlapped with every stage's last
    backward; at least the last bucket is exposed), plus what ZeRO-1's parameter all-gather
    leaves exposed ahead of the next forward (overlap.py; both per the layout's overlap flags)
  + the optimizer step (memory-bound)

An MoE layer (``moe_layer_change``) replaces its MLP's time by the router's, its experts' and the
shared expert's: with ETP = 1 every TP rank holds the same experts and the same tokens, so the
router and the experts run whole on each TP rank, T K rows per rank under balanced routing
whatever the ep; with ETP = tp each TP rank runs 1/tp of every expert on the same T K rows and
the combined output is all-reduced over TP (forward; the inputs' gradients backward; with SP the
TP ranks' shards are gathered in and the output reduce-scattered out, the experts computing the
TP group's tokens); its
permutation passes are memory-bound; the dispatch and combine all-to-alls
(forward, backward, and again under full recomputation; the allgather dispatcher's gathers and
reduce-scatters, moe_allgather.py) run over the EP group's links and are
exposed (the engine does not overlap them): ``ep_comm``; what the engine adds (moe_time.py: the
launches of its routing and permutation kernels, the one host wait per layer and forward under
EP: ``moe_overhead``; the busiest EP rank's extra work under a load imbalance: ``moe_imbalance``).
The experts' gradients are reduced over
their EDP group's links (overlap.py, with the dense ones).

``TimeTerms`` holds them; a new term (a zero-bubble schedule's, ZeRO-2's) is one more field and
the line that fills it. All constants live in engine/plan/model.py, explained in docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.plan.flops import (StepFlops, attention_core_forward_flops, layer_forward_flops,
                               logits_forward_flops, recomputed_layer_flops, routed_tokens,
                               step_flops)
from engine.plan.model import (ACT_BYTES, COLLECTIVE_LATENCY_S, EW_MLP, EW_REPLICATED, EW_SCORES,
                               EW_SHARDED_ATTN, LAYER_PASS_OVERHEAD_S, OPTIMIZER_BYTES_PER_PARAM,
                               Cluster, Layout, ModelShape, num_micro_batches)
from engine.plan.memory import MemoryTerms, memory_per_device, stage_param_split
from engine.plan.params import stage_layer_count, stage_moe_layers
from engine.plan.collectives import allreduce_s, gather_or_scatter_s
from engine.plan.fp8 import linear_rate
from engine.plan.moe_time import moe_layer_change
from engine.plan.overlap import data_parallel_overlap, ring_recompute_extra_flops, tp_layer_overlap
from engine.plan.zero3 import gather_overlap
from engine.plan.passes import Links, PassTime, _rates, layout_links  # noqa: F401 (re-exported)
from engine.plan.traffic import moe_sp_grad_sync
from engine.plan.offload import (HostTerms, host_fits, most_host_terms, offload_terms,
                                 shard_elements)




def layer_time(shape: ModelShape, cluster: Cluster, layout: Layout, links: Links) -> PassTime:
    """One layer, one micro-batch, forward + backward (+ recomputation) on one device."""
    s, b, h, a = shape.seq_length, layout.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    t, c, f, rc, sp = layout.tp, layout.cp, shape.ffn_hidden_size, layout.recompute, layout.sequence_parallel
    rate, mem_s = _rates(cluster)
    tokens = s * b / c  # this rank's share of the micro-batch's positions
    sbh = tokens * h
    gemm = layer_forward_flops(tokens, s, h, f, shape.block, shape.kv_hidden) / t
    attn = attention_core_forward_flops(tokens, s, h) / t
    lin_rate = linear_rate(cluster, shape)   # the TP linears' GEMMs: FP8 under --fp8-format (fp8.py)
    gemm_s = (gemm - attn) / lin_rate + attn / rate
    scores = 0.0 if shape.fused_attention else EW_SCORES * a * s * s * b / t
    ew = (EW_REPLICATED * sbh / (t if sp else 1)
          + (EW_SHARDED_ATTN * sbh + EW_MLP[shape.block] * tokens * f) / t + scores)
    fwd = gemm_s + mem_s(ew) + LAYER_PASS_OVERHEAD_S
    bwd = 2 * gemm_s + mem_s(2 * ew) + LAYER_PASS_OVERHEAD_S  # dX and dW GEMMs, gemm each
    redo = recomputed_layer_flops(tokens, s, h, f, shape.block, rc, shape.recompute_early_stop,
                                  shape.kv_hidden) / t
    redo_s = attn / rate + (redo - attn) / lin_rate if rc == "full" else redo / rate
    recompute = {"full": redo_s + mem_s(ew) + LAYER_PASS_OVERHEAD_S,
                 "selective": redo_s + mem_s(scores) + LAYER_PASS_OVERHEAD_S, "none": 0.0}[rc]
    # TP: the two column-parallel inputs (QKV, MLP) and two row-parallel outputs of a layer. Without
    # SP: an all-reduce after each row-parallel layer forward, one of each column input's gradient
    # backward. With SP: all-gather + reduce-scatter pairs each way, plus the all-gather of each
    # column-parallel input's saved s/tp shard in backward. A recomputed forward repeats its own.
    # Early stop leaves out the down projection's collective (the last one of the forward).
    # With --tp-comm-overlap (SP only) each of them is a ring of tp chunks beside its GEMM
    # (overlap.py): the exposed part is counted here, the hidden part kept for --explain.
    msg = ACT_BYTES * sbh
    tp_hidden = 0.0
    if sp and layout.tp_comm_overlap and t > 1:
        rings = tp_layer_overlap(shape, layout, tokens, links.tp, lin_rate, cluster.overlap.tp)
        tp_fwd, tp_re, tp_bwd = (r.exposed for r in rings)
        tp_hidden = sum(r.hidden for r in rings)
        recompute += ring_recompute_extra_flops(shape, layout, tokens) / lin_rate
    else:
        one = (gather_or_scatter_s if sp else allreduce_s)(msg, t, links.tp)
        tp_fwd, tp_bwd = (4 * one, 6 * one) if sp else (2 * one, 2 * one)
        tp_re = (tp_fwd - (one if shape.recompute_early_stop else 0.0)) if rc == "full" else 0.0
    # CP ring (parallel/context_parallel/ring.py): each hop passes a rank's K and V chunks, 2 b s h_kv
    # / (cp tp) elements, to the next rank: cp-1 hops forward; backward cp-1 hops of K and V and cp of
    # their dK, dV accumulators. A hop hides only behind the attention block computed while it is in
    # flight (the rank's attention core is cp equal blocks, one per ring step; each step waits for
    # its hops before the next): forward, block i hides the K/V hop i+1; backward, block i hides
    # the K/V hop i+1 and block i-1's dK/dV hop (two hops on one link; the first and the last step
    # one), and the last dK/dV hop, which returns the accumulators to their owners, has nothing
    # left to hide behind. ``cp_ring`` keeps the whole exchange for --explain.
    cp_fwd = cp_bwd = cp_re = cp_ring = 0.0
    if c > 1:
        hop = 2 * b * s * shape.kv_hidden / (c * t) * ACT_BYTES / (links.cp * 1e9) + COLLECTIVE_LATENCY_S
        block_f = attn / rate / c
        block_b = 2 * block_f
        cp_fwd = (c - 1) * max(0.0, hop - block_f)
        cp_bwd = 2 * max(0.0, hop - block_b) + (c - 2) * max(0.0, 2 * hop - block_b) + hop
        redo = rc in ("full", "selective")
        cp_re = cp_fwd if redo else 0.0
        cp_ring = ((c - 1) * (2 if redo else 1) + 2 * c - 1) * hop
    backward = bwd + recompute + tp_bwd + tp_re + cp_bwd + cp_re
    return PassTime(fwd + bwd, recompute, tp_fwd + tp_bwd + tp_re, cp_fwd + cp_bwd + cp_re, 0.0, backward,
                    gemm_s, cp_ring, tp_hidden)




def pipeline_ends(shape: ModelShape, cluster: Cluster, layout: Layout,
                  links: Links) -> tuple[PassTime, PassTime, PassTime]:
    """Per micro-batch: the embedding (first device), the logits and loss (last), and pipeline p2p.
    The output layer's GEMMs and the cross-entropy's passes run over the vocabulary as the engine
    allocates it, padded to a multiple of 128 x tp (``ModelShape.padded_vocab``)."""
    s, b, h, t, c = (shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp,
                     layout.cp)
    V = shape.padded_vocab(t)
    sp = layout.sequence_parallel
    rate, mem_s = _rates(cluster)
    tokens = s * b / c
    sbh = tokens * h
    msg = ACT_BYTES * sbh
    # vocab-parallel embedding: an all-reduce (SP: a reduce-scatter) of its output forward
    embed_tp = gather_or_scatter_s(msg, t, links.tp) if sp else allreduce_s(msg, t, links.tp)
    embedding = PassTime(compute=mem_s(3 * 4 * sbh), tp_comm=embed_tp)
    # output layer: its input's gradient all-reduced (SP: gathered forward, scattered backward);
    # vocab-parallel cross-entropy: three all-reduces of s b floats (max, sum of exp, target logit)
    logits_tp = (2 * gather_or_scatter_s(msg, t, links.tp) if sp else allreduce_s(msg, t, links.tp))
    logits_tp += 3 * COLLECTIVE_LATENCY_S if t > 1 else 0.0
    logits = PassTime(compute=3 * logits_forward_flops(tokens, h, V) / t / rate
                      + mem_s(20 * tokens * V / t + 3 * 4 * sbh), tp_comm=logits_tp,
                      backward=2 * logits_forward_flops(tokens, h, V) / t / rate,
                      weight=logits_forward_flops(tokens, h, V) / t / rate)
    p2p = PassTime()
    if layout.pp > 1:
        # one activation forward and one gradient backward per model chunk. Each TP rank sends 1/t
        # of the tensor; without SP the receiver all-gathers the full (replicated) tensor over TP
        # (Megatron's scatter/gather); with SP the tensor already is each rank's sequence shard.
        send = msg / t / (links.pp * 1e9) + COLLECTIVE_LATENCY_S
        regather = 0.0 if sp else gather_or_scatter_s(msg, t, links.tp)
        per_message = send + regather
        p2p = PassTime(pp_comm=2 * layout.vp * per_message, backward=layout.vp * per_message)
    return embedding, logits, p2p


@dataclass(frozen=True)
class TimeTerms:
    """Seconds of one optimizer step, by term; they add up to the step time."""
    compute: float  # forward + backward of every micro-batch (mean device), recomputation excluded
    recompute: float  # recomputed forwards
    tp_comm: float  # TP collectives (incl. SP's backward re-gather, the embedding and loss)
    cp_comm: float  # exposed part of the CP ring exchange (the whole one: Estimate.cp_ring_s)
    pp_comm: float  # pipeline p2p + the all-gather that rebuilds a received activation
    ep_comm: float  # MoE dispatch and combine over the EP group (all-to-alls or gathers; exposed)
    moe_overhead: float  # the MoE layers' kernel launches and host waits (moe_time.py)
    moe_imbalance: float  # the busiest EP rank's extra expert and all-to-all time
    bubble: float  # the schedule's idle time (pipeline_bubble_s)
    imbalance: float  # the slowest device (first or last, carrying an end) setting the pace
    dp_comm: float  # exposed DP gradient reduction (all-reduce; ZeRO: reduce-scatter)
    zero_allgather: float  # ZeRO's parameter all-gathers: 1/2 after the update, 3 per unit (zero3.py)
    optimizer: float  # Adam step on the device, memory-bound (offload: the part left there)
    offload_copy: float = 0.0  # --optimizer-cpu-offload: gradients down, weights up (offload.py)
    host_update: float = 0.0  # --optimizer-cpu-offload: the host's AdamW over the offloaded shard

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    time: TimeTerms
    memory: MemoryTerms
    fits: bool
    flops: StepFlops
    num_devices: int
    peak_tflops: float
    links: Links
    cp_ring_s: float = 0.0  # the whole CP ring exchange of the step; time.cp_comm is its exposed part
    # seconds of each communication term hidden under compute (the term itself is what is exposed)
    hidden: dict = field(default_factory=dict)
    efficiency: object = None  # the cluster's hardware.OverlapEfficiency the estimate used
    host: HostTerms = HostTerms()  # --optimizer-cpu-offload: host memory of the device's process

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def memory_bytes_per_device(self) -> float:
        return self.memory.total

    @property
    def model_tflops_per_device(self) -> float:
        return self.flops.model / self.step_time_s / self.num_devices / 1e12

    @property
    def tflops_per_device(self) -> float:
        """Executed (hardware) TFLOP/s per device: recomputation included, as Megatron reports."""
        return self.flops.executed / self.step_time_s / self.num_devices / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_device / self.peak_tflops

    @property
    def hfu(self) -> float:
        return self.tflops_per_device / self.peak_tflops

    def as_row(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp,
                "vp": lay.vp,
                "schedule": lay.pipeline_schedule,
                "micro_batch_size": lay.micro_batch_size, "recompute": lay.recompute, "zero": lay.zero,
                "sequence_parallel": lay.sequence_parallel, "order": lay.order,
                "memory_bytes_per_device": int(self.memory_bytes_per_device),
                "step_time_s": self.step_time_s, "tflops_per_device": self.tflops_per_device,
                "model_tflops_per_device": self.model_tflops_per_device,
                "mfu": self.mfu, "hfu": self.hfu,
                "tp_comm_overlap": lay.tp_comm_overlap, "overlap_grad_reduce": lay.overlap_grad_reduce,
                "overlap_param_gather": lay.overlap_param_gather,
                "zero_stage": lay.zero_stage if lay.zero else 0, "offload": lay.offload,
                "time_terms": self.time.as_dict(), "comm_hidden": dict(self.hidden),
                "memory_terms": self.memory.as_dict(), "host_memory_terms": self.host.as_dict()}


def pipeline_bubble_s(layout: Layout, m: int, mean: PassTime) -> float:
    """Seconds a device idles in one step for the layout's schedule, from the mean device's times
    per micro-batch: forward ``T_F`` (total less backward), input gradient ``T_B`` (backward less
    W) and weight gradients ``T_W`` (``PassTime.weight``).

    1F1B: (p-1)(T_F + T_B + T_W); interleaved: that over v (Narayanan et al. 2021). ZB-H1 (Qi et
    al. 2024, sec. 3.1): (p-1)(T_F + T_B - T_W) for T_W <= T_F, (p-1) T_B above it, plus T_W for
    each micro-batch fewer than stages. ZB-V (chunks of half a stage): (p-1) max(T_F, T_B) / 2, or
    the dependency chain of the last micro-batches, (4m + 4p - 2) chunk steps, when m is small.
    With equal T_F, T_B, T_W these are the closed forms of parallel/pipeline/bubble.py (the
    replays of the schedules give them exactly; tests/parallel/pipeline/test_zero_bubble_schedules.py).
    """
    p, v, total = layout.pp, layout.vp, mean.total
    if p == 1:
        return 0.0
    t_f, t_w = total - mean.backward, mean.weight
    t_b = mean.backward - t_w
    if layout.schedule == "zb-h1":
        return (p - 1) * (t_b + max(0.0, t_f - t_w)) + max(0, p - m) * t_w
    if layout.schedule == "zb-v":
        return max((p - 1) * max(t_f, t_b) / 2, (4 * m + 4 * p - 2) * total / 6 - m * total)
    return (p - 1) / v * total


def optimizer_params(shape: ModelShape, layout: Layout) -> float:
    """Weights whose optimizer step the most loaded device runs: the first or the last device's
    (with MoE layers any device's), under ZeRO its shard (dense ones over dp x cp, experts over
    their EDP group)."""
    p = layout.pp
    stages = range(p) if shape.moe is not None else (0, p - 1)
    return max(shard_elements(layout, *stage_param_split(shape, layout, stage)) for stage in stages)


def estimate(shape: ModelShape, cluster: Cluster, layout: Layout) -> Estimate:
    """Memory and step time of a layout that obeys check_layout (not re-checked here)."""
    p, m = layout.pp, num_micro_batches(shape, layout)
    links = layout_links(cluster, layout)
    mem = memory_per_device(shape, layout, cluster.backend)
    layer = layer_time(shape, cluster, layout, links)
    embedding, logits, p2p = pipeline_ends(shape, cluster, layout, links)
    # stage i's layers (fewer at the ends with --stage-end-weight); with MoE layers each stage
    # adds its own count of moe_layer_change
    bodies = [layer.scale(stage_layer_count(shape, layout, i)) for i in range(p)]
    if shape.moe is not None:
        change = moe_layer_change(shape, cluster, layout, links)
        bodies = [body + change.scale(stage_moe_layers(shape, layout, i))
                  for i, body in enumerate(bodies)]
    if p == 1:
        stages = [bodies[0] + embedding + logits]
    elif layout.v_placement:  # device 0 runs the first and the last virtual stage
        stages = [bodies[0] + embedding + logits + p2p] + [b + p2p for b in bodies[1:]]
    else:  # the last stage is kept second
        stages = [bodies[0] + embedding + p2p, bodies[-1] + logits + p2p] + [b + p2p for b in bodies[1:-1]]
    mean = sum(stages[1:], stages[0]).scale(1 / p)
    slowest = max(stages, key=lambda st: st.total)
    # DP and ZeRO (overlap.py): each stage's gradients reduced over its dp x cp ranks per bucket
    # under its last backward (the first stage's ends the step), ZeRO's gather ahead of the next
    # forward; stages in pipeline order (``stages`` holds the last one second).
    ordered = stages if p == 1 or layout.v_placement else [stages[0]] + stages[2:] + [stages[1]]
    dp, zero = data_parallel_overlap(shape, cluster, layout, links.dp,
                                     [st.backward for st in ordered],
                                     [st.total - st.backward for st in ordered], links.edp)
    if layout.zero3:  # its gathers per unit replace ZeRO-1/2's after the update (zero3.py)
        zero = gather_overlap(shape, cluster, layout, links.dp, links.edp,
                              unit_seconds(shape, layout, layer, embedding, logits,
                                           moe_layer_change(shape, cluster, layout, links)))
    copies, host_s = offload_terms(shape, cluster, layout, [st.backward for st in ordered])
    _, mem_s = _rates(cluster)
    opt_params = optimizer_params(shape, layout) * (1.0 - layout.offload)
    # once per step: the MoE layers' partial gradients summed over TP (the most loaded stage's)
    sp_sync = max(moe_sp_grad_sync(shape, layout, i) for i in range(p))
    sync_s = allreduce_s(sp_sync, layout.tp, links.tp) if sp_sync else 0.0
    terms = TimeTerms(compute=m * mean.compute, recompute=m * mean.recompute,
                      tp_comm=m * mean.tp_comm + sync_s,
                      cp_comm=m * mean.cp_comm, pp_comm=m * mean.pp_comm, ep_comm=m * mean.ep_comm,
                      moe_overhead=m * mean.moe_overhead, moe_imbalance=m * mean.moe_imbalance,
                      bubble=pipeline_bubble_s(layout, m, mean),
                      imbalance=m * (slowest.total - mean.total),
                      dp_comm=dp.exposed, zero_allgather=zero.exposed,
                      optimizer=mem_s(opt_params * OPTIMIZER_BYTES_PER_PARAM),
                      offload_copy=copies.exposed, host_update=host_s)
    flops = step_flops(shape.global_batch_size, shape.seq_length, shape.num_layers, shape.hidden_size,
                       shape.vocab_size, shape.ffn_hidden_size, shape.block, layout.recompute,
                       shape.recompute_early_stop, shape.kv_hidden, moe=shape.moe,
                       routed_tokens=routed_tokens(layout.micro_batch_size, shape.seq_length,
                                                   layout.cp, layout.tp, layout.sequence_parallel,
                                                   layout.etp),
                       padded_vocab=shape.padded_vocab(layout.tp))  # executed only (flops.py)
    fits = mem.total <= cluster.usable_bytes and host_fits(shape, cluster, layout)
    hidden = {"tp_comm": m * mean.tp_hidden, "cp_comm": max(0.0, m * (mean.cp_ring - mean.cp_comm)),
              "pp_comm": 0.0, "dp_comm": dp.hidden, "zero_allgather": zero.hidden,
              "offload_copy": copies.hidden}
    return Estimate(layout, terms, mem, fits, flops, cluster.num_devices, cluster.peak_tflops, links,
                    cp_ring_s=m * mean.cp_ring, hidden=hidden,
                    efficiency=cluster.overlap, host=most_host_terms(shape, layout))


def unit_seconds(shape: ModelShape, layout: Layout, layer: PassTime, embedding: PassTime,
                 logits: PassTime, moe_change: PassTime):
    """(stage, zero3_units.Unit) -> (forward, backward) seconds per micro-batch of the unit: a layer's
    (an MoE layer's with its change), the embedding's, the output layer's and loss'; 0 for the
    norms and the position table, which compute next to nothing."""
    def times(stage: int, unit) -> tuple[float, float]:
        if unit.layer is not None:
            one = layer + moe_change if shape.is_moe(unit.layer) else layer
        else:
            one = {"embedding": embedding, "output": logits}.get(unit.name, PassTime())
        return one.total - one.backward, one.backward
    return times
