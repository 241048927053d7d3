"""Bytes per step that one device hands to collectives, by group kind: the planner's messages
(timing.py prices the same ones) counted the way the engine's communication layer counts payload
(parallel/runtime/comm.py): an all-reduce and a reduce-scatter their whole input, an all-gather its
own shard, a point-to-point transfer the tensor it sends. ``engine.dryrun`` compares these with the
bytes the engine's own step issues.

Per micro-batch and layer, with ``msg = e s b h / cp`` (e: bytes per activation element) on tp
ranks (t > 1):

    no SP    forward: 2 all-reduces (msg)           backward: 2 all-reduces (msg)
    SP       forward: 2 all-gathers (msg/t) and 2 reduce-scatters (msg)
             backward: 2 reduce-scatters (msg) and 2 all-gathers (msg/t), and the all-gathers
             of the two column-parallel inputs' saved sequence shards (msg/t each)
    full recompute repeats the forward's, less the one after the down projection when the early
             stop holds (no residual dropout: ModelShape.recompute_early_stop)
    --tp-comm-overlap (SP): every gather and scatter a ring of t - 1 sends of msg/t, 10 rings per
             layer (overlap.py ``tp_layer_rings``), 4 more under full recomputation

The embedding adds an all-reduce (SP: a reduce-scatter forward and an all-gather backward), the
output layer the all-reduce of its input's gradient (SP: an all-gather forward, a reduce-scatter
backward) and vocab-parallel cross-entropy two fp32 all-reduces of ``4 s b / cp`` and ``8 s b / cp``
bytes. Pipeline: per model chunk an activation forward and a gradient backward, 1/t of the
tensor each (Megatron's scatter/gather: without SP the receiver all-gathers it over TP, msg/t).
Context parallelism (ring attention): per layer cp-1 hops of the K and V blocks forward, cp-1 of
them and cp of their dK/dV accumulators backward, ``2 e b s kv_hidden / (cp t)`` bytes each (again
forward under recomputation). Data parallelism: the fp32 gradients of the device's weights
(all-reduce, or reduce-scatter under ZeRO) and ZeRO's all-gathers of the weights (own shard):
ZeRO-1/2 once a step, ZeRO-3 every gather unit twice per model chunk and micro-batch (forward
and backward) and its kept units once (engine/plan/zero3.py).
Tied embeddings (gpt2, pp > 1): the first and last stages all-reduce the embedding's fp32
gradient (its ZeRO shard). FP8 (``--fp8-format``): every FP8 layer's calls add the MAX
all-reduces of their scales' amaxes over TP and over CP, and the experts' over EDP under EP
with CP (engine/plan/fp8.py ``amax_bytes``). Not counted: the statistics all-reduce, the
gradient norm's and the
pipeline bubble's scalars (a few bytes), Ulysses' all-to-alls (``--cp-comm-type a2a``: None).

Mixture of experts (``ModelShape.moe``, ``Layout.ep``; parallel/expert_parallel/dispatch.py), per
MoE layer and micro-batch with ep > 1 (kind ``ep``): forward, the count exchange (an equal-split
all-to-all of the (ep, E/ep) int64 table, ``8 E`` bytes) and two all-to-alls of the ``T K`` routed
rows (T = s b tokens, K = top-k: ``e T K h`` bytes each, dispatch and combine; the payload is the
whole send buffer, the rows a rank keeps included; dropless routing); backward, the two again
with the gradients; a full recomputation repeats the forward's three. The experts' gradients are
reduced over the expert-data-parallel group (kind ``edp``, dp x cp / ep ranks) instead of dp x cp;
with ep = 1 that group is the dp x cp group and they count as ``dp``. The allgather dispatcher
(``--moe-token-dispatcher-type allgather``) gathers every EP rank's tokens, routing table and
router weights and reduce-scatters the combined output instead (engine/plan/moe_allgather.py,
whatever the routing; padded to capacity its table is the E C slots).
"""
from __future__ import annotations

from engine.plan import moe_allgather
from engine.plan.model import GRAD_BYTES, Layout, ModelShape, moe_expert_rows, num_micro_batches
from engine.plan.fp8 import amax_bytes
from engine.plan.memory import stage_param_split
from engine.plan.params import (expert_params_per_layer, stage_layer_count, stage_layers,
                                stage_moe_layers)
from engine.plan.zero3_units import gather_bytes

KINDS = ("tp", "cp", "pp", "dp", "embedding", "ep", "edp")
COUNT_BYTES = 8  # an int64 per expert in the count exchange


def _tp_per_layer(shape: ModelShape, layout: Layout, msg: float) -> float:
    """A dense layer's TP bytes per micro-batch (the module docstring). Full recomputation repeats
    the forward's collectives, less the MLP's last one when the early stop holds
    (``shape.recompute_early_stop``: no residual dropout). With ``--tp-comm-overlap`` (SP) each
    gather and scatter is a ring of tp - 1 sends of msg/t (overlap.py ``tp_layer_rings``: the
    recomputation repeats all four forward rings, early stop or not), and a zero-bubble W's
    re-gathers stay plain all-gathers (msg/t)."""
    t, sp = layout.tp, layout.sequence_parallel
    if t == 1:
        return 0.0
    full = layout.recompute == "full"
    if sp and layout.tp_comm_overlap:
        from engine.plan.overlap import tp_layer_rings
        rings = tp_layer_rings(shape, layout, msg / shape.activation_bytes / shape.hidden_size)
        return rings.rings * (t - 1) * msg / t + rings.plain * msg / t
    if sp:
        fwd, bwd = 2 * (msg / t + msg), 2 * (msg + msg / t) + 2 * msg / t
    else:
        fwd = bwd = 2 * msg
    # the forward's again; with the early stop not the last (SP: the MLP's reduce-scatter)
    redo = fwd - (msg if shape.recompute_early_stop else 0.0)
    return fwd + bwd + (redo if full else 0.0)


def _mlp_tp_per_layer(shape: ModelShape, layout: Layout, msg: float) -> float:
    """The dense MLP's share of ``_tp_per_layer``: no SP, its row-parallel output's all-reduce
    forward and its column-parallel input's gradient all-reduce backward; SP, a gather and a
    scatter each way, the backward re-gather of its input's shard and, under full recomputation,
    the forward's gather again (and its scatter, unless the early stop leaves it out)."""
    t, sp = layout.tp, layout.sequence_parallel
    if t == 1:
        return 0.0
    last = 0.0 if shape.recompute_early_stop else msg
    full = layout.recompute == "full"
    if sp:
        return 2 * (msg / t + msg) + msg / t + (msg / t + last if full else 0.0)
    return 2 * msg + (last if full else 0.0)


def moe_tp_per_layer(shape: ModelShape, layout: Layout, msg: float) -> float:
    """What an MoE layer changes in ``_tp_per_layer``'s bytes per micro-batch (models/moe/layer.py):
    without a shared expert the dense MLP's TP collectives are gone (the router and the experts are
    whole, or ETP-split, on every TP rank: no gather, scatter or TP-split matrix; the shared expert
    is a dense TP MLP and issues what the MLP it replaces did). With ETP = tp the experts' partial
    outputs are summed over TP: forward the all-reduce of the combined (T, h) output (``msg``),
    backward the all-reduce of the tokens' gradient (``msg``, ``copy_to_tp``) and of the router
    weights' fp32 (T, K) gradient; full recomputation repeats the forward's all-reduce when a
    shared expert follows it (without one it is the layer's last collective, and the early stop
    skips it). With sequence parallelism as well, the shards' tokens, router weights and experts
    are all-gathered and the output reduce-scattered instead (their gradients the other way)."""
    if shape.moe is None or layout.tp == 1:
        return 0.0
    change = 0.0 if shape.moe.shared_ffn else -_mlp_tp_per_layer(shape, layout, msg)
    if layout.etp == 1:
        return change
    t, k = layout.tp, shape.moe.topk
    tokens = msg / shape.activation_bytes / shape.hidden_size
    last = msg if layout.recompute == "full" and (shape.moe.shared_ffn
                                                  or not shape.recompute_early_stop) else 0.0
    if not layout.sequence_parallel:
        return change + 2 * msg + 4 * tokens * k + last
    # SP: forward the gathers of the shards' tokens, fp32 router weights and int64 experts, and the
    # reduce-scatter of the combined output; backward the reduce-scatters of the tokens' and
    # weights' gradients and the gather of the output's; full recomputation the gathers again
    gathers = msg / t + (4 + 8) * tokens / t * k
    return change + gathers + msg + msg + 4 * tokens * k + msg / t + (
        gathers + last if layout.recompute == "full" else 0.0)


def moe_sp_grad_sync(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Bytes the MoE layers add to the once-per-step all-reduce over TP of the gradients marked
    ``sequence_parallel`` (parallel/grads/main_grad.py; fp32; under ZeRO this rank's shards: the
    router's over dp x cp, the experts' over EDP, 1/shards on average). Under sequence parallelism
    each TP rank routes its own tokens, so the router's (E, h) gradient and, with ETP = 1, its whole
    experts' are partial sums over TP (models/moe/layer.py); with ETP = tp, SP or not, the expert
    slices are whole but the gpt2 experts' fc2 biases (E/ep per MoE layer, whole on every TP
    rank, used by ETP rank 0 only, models/moe/experts.py) are. Zero with tp = 1. (The dense
    layers' sequence-parallel norms and biases are not counted here.)"""
    moe = shape.moe
    if moe is None or layout.tp == 1:
        return 0.0
    layers, h = stage_moe_layers(shape, layout, stage), shape.hidden_size
    edp = layout.edp if layout.zero else 1
    dense_shards = layout.dp * layout.cp if layout.zero else 1
    count = 0.0
    if layout.sequence_parallel:
        count += layers * moe.num_experts * h / dense_shards
        if layout.etp == 1:
            count += layers * expert_params_per_layer(shape, layout.ep) / edp
    if layout.etp > 1 and shape.block == "gpt2":
        count += layers * moe.num_experts // layout.ep * h / edp
    return count * GRAD_BYTES


def qk_norm_grad_sync(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Bytes the --qk-layernorm norms add to that once-per-step all-reduce over TP: each TP rank
    normed its own heads, so both (head_dim,) weights' gradients are partial sums (fp32; under
    ZeRO this rank's shards, 1/(dp x cp) on average). Zero with tp = 1."""
    if not shape.qk_layernorm or layout.tp == 1:
        return 0.0
    shards = layout.dp * layout.cp if layout.zero else 1
    head_dim = shape.hidden_size // shape.num_attention_heads
    return stage_layer_count(shape, layout, stage) * 2 * head_dim * GRAD_BYTES / shards


def _sends(layout: Layout, stage: int) -> tuple[int, int]:
    """(activations sent, gradients sent) per micro-batch by pipeline rank ``stage``: one per
    chunk, except forward out of the last virtual stage and backward out of the first. In zb-v's
    V the turn from chunk 0 to chunk 1 on rank p-1 is local, and rank 0 holds both ends: each end
    rank sends one activation and one gradient, the others two of each. Receives mirror sends."""
    v, p = layout.vp, layout.pp
    if layout.v_placement:
        inner = (stage != 0) + (stage != p - 1)
        return inner, inner
    return v - (stage == p - 1), v - (stage == 0)


def step_traffic(shape: ModelShape, layout: Layout, stage: int,
                 cp_comm_type: str = "p2p") -> dict[str, float | None]:
    """{kind: payload bytes per step} of a device of pipeline rank ``stage`` (see the module doc)."""
    s, b, h, t, c, p = (shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp,
                        layout.cp, layout.pp)
    e, m, sp = shape.activation_bytes, num_micro_batches(shape, layout), layout.sequence_parallel
    tokens = s * b / c
    msg = e * tokens * h
    layers = stage_layer_count(shape, layout, stage)
    tp = layers * _tp_per_layer(shape, layout, msg) \
        + stage_moe_layers(shape, layout, stage) * moe_tp_per_layer(shape, layout, msg)
    fp8_tp, fp8_cp, fp8_edp = stage_amax_bytes(shape, layout, stage)  # FP8's scales (fp8.amax_bytes)
    tp += fp8_tp
    if t > 1 and stage == 0:
        tp += msg + msg / t if sp else msg                      # the embedding
        if sp and shape.block == "gpt2":
            tp += e * s * h / c / t                              # position table's gradient
    if t > 1 and stage == p - 1:
        tp += (msg / t + msg if sp else msg) + 12 * tokens       # output layer, cross-entropy
    pp = 0.0
    if p > 1:
        acts, grads = _sends(layout, stage)
        pp = (acts + grads) * msg / t
        if t > 1 and not sp:                                     # re-gather on every receive
            tp += (acts + grads) * msg / t
    cp = 0.0
    if c > 1:
        if cp_comm_type != "p2p":
            cp = None
        else:
            block = 2 * e * b * (s / c) * shape.kv_hidden / t
            hops = (c - 1) * (2 if layout.recompute in ("full", "selective") else 1) + (c - 1) + c
            cp = layers * hops * block + fp8_cp
    dense, expert = stage_param_split(shape, layout, stage)
    shards, ep = layout.dp * c, layout.ep
    edp_ranks = shards // ep
    # with ep = 1 the experts reduce over the dp x cp group itself
    params, experts = (dense + expert, 0.0) if ep == 1 else (dense, expert)
    dp = edp = 0.0
    # ZeRO-1/2 gather each weight's shard once after the update, ZeRO-3 each unit twice per chunk
    # and micro-batch (zero3_units.gather_bytes)
    gather_dp, gather_edp = ((params / shards * shape.weight_bytes if layout.zero else 0.0),
                             (experts / edp_ranks * shape.weight_bytes if layout.zero else 0.0))
    if layout.zero3:
        gather_dp, gather_edp = gather_bytes(shape, layout, stage)
    if shards > 1:
        dp = params * GRAD_BYTES + gather_dp
    if experts and edp_ranks > 1:
        edp = experts * GRAD_BYTES + gather_edp
    embedding = 0.0
    if shape.block == "gpt2" and p > 1 and stage in (0, p - 1) and not layout.v_placement:
        embedding = shape.padded_vocab(t) * h / t * GRAD_BYTES / (shards if layout.zero else 1)
    tp = m * tp + moe_sp_grad_sync(shape, layout, stage) + qk_norm_grad_sync(shape, layout, stage)
    return {"tp": tp, "cp": None if cp is None else m * cp, "pp": m * pp, "dp": dp,
            "embedding": embedding, "ep": m * stage_moe_layers(shape, layout, stage) * ep_per_layer(shape, layout),
            "edp": edp + m * fp8_edp}


def stage_amax_bytes(shape: ModelShape, layout: Layout,
                     stage: int) -> tuple[float, float, float]:
    """(TP, CP, EDP) bytes per micro-batch of the FP8 scales' MAX all-reduces of pipeline rank
    ``stage``'s FP8 layers (engine/plan/fp8.py ``amax_bytes``; 0 without --fp8-format)."""
    total = [0.0, 0.0, 0.0]
    for layer in stage_layers(shape, layout, stage):
        if shape.is_fp8(layer):
            total = [a + b for a, b in zip(total, amax_bytes(shape, layout, shape.is_moe(layer)))]
    return tuple(total)


def ep_per_layer(shape: ModelShape, layout: Layout) -> float:
    """Payload bytes one rank hands to the dispatch all-to-alls of one MoE layer per micro-batch
    (the module docstring): ``(4 + 2 redo) e T K h + (1 + redo) 8 E``, padded to capacity
    ``(4 + 2 redo) e E C h`` (``moe_expert_rows``; no counts); the allgather dispatcher's
    gathers and reduce-scatters instead (moe_allgather.py); 0 with ep = 1."""
    if shape.moe is None or layout.ep == 1:
        return 0.0
    if shape.moe.dispatcher == "allgather":
        return moe_allgather.payload_bytes(shape, layout)
    redo = 1 if layout.recompute == "full" else 0
    rows = shape.activation_bytes * moe_expert_rows(shape, layout) * shape.hidden_size
    counts = 0 if shape.moe.padded_capacity_factor else (1 + redo) * COUNT_BYTES * shape.moe.num_experts
    return (4 + 2 * redo) * rows + counts
