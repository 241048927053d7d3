"""The memory model: bytes on a pipeline device (weights, gradients, optimizer state, activations
in flight, transients, the ends of the model, communicator buffers), what search.py checks a
layout against and engine/dryrun compares with the engine's own allocations.

Korthikanti et al. 2022's activation terms for any FFN width and block; every constant is in
model.py and explained in docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.plan import moe_allgather
from engine.plan.fp8 import fp8_gemm_copy_bytes, fp8_scale_bytes
from engine.plan.constants import ROPE_BLOCKS
from engine.plan.model import (ACT_MASK_BYTES, ACT_MOE_FP32_PER_EXPERT, ACT_MOE_INDEX_BYTES,
                               moe_expert_rows, moe_expert_tokens, moe_tokens,
                               ACT_MOE_ROWS, ACT_TENSORS_MLP, ACT_TENSORS_REPLICATED,
                               ACT_TENSORS_SPLIT_ATTN, COMM_BUFFER_BYTES, GRAD_BYTES,
                               OPTIMIZER_STATE_BYTES, P2P_BUFFER_BYTES, Layout, ModelShape,
                               num_micro_batches)
from engine.plan.params import (expert_params_per_layer, layer_params_per_device,
                                moe_dense_change_per_layer, stage_fp8_layers, stage_layer_count,
                                stage_moe_layers)
from engine.plan.zero3_units import gathered_bytes


def stage_param_split(shape: ModelShape, layout: Layout, stage: int) -> tuple[float, float]:
    """(dense weights, expert weights) on a device of pipeline rank ``stage``: the expert ones are
    the MoE layers' experts (E/ep per rank, 1/etp of each; reduced over the EDP group of
    dp x cp / ep ranks, sharded over it under ZeRO, whatever the etp), the dense
    ones everything else (``stage_param_count`` without MoE layers; the router and the shared
    expert are dense)."""
    total = _stage_dense_count(shape, layout, stage)
    moe_layers = stage_moe_layers(shape, layout, stage)
    if not moe_layers:
        return total, 0.0
    return (total + moe_layers * moe_dense_change_per_layer(shape, layout.tp),
            moe_layers * expert_params_per_layer(shape, layout.ep, layout.etp))


def stage_param_count(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Every weight on a device of pipeline rank ``stage``, dense and expert (``stage_param_split``)."""
    return sum(stage_param_split(shape, layout, stage))


def _stage_dense_count(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Weights on a device of pipeline rank ``stage`` with dense MLPs: its layers (``stage_layer_count``), on the
    first the word (V_pad h / t) and, for gpt2, position embeddings (--max-position-embeddings rows), on the last the output layer (for
    gpt2 with pp > 1 its own copy of the tied embedding) and the final norm; under zb-v the first
    holds the output layer and final norm too (the tied embedding is then one parameter)."""
    h, t, p = shape.hidden_size, layout.tp, layout.pp
    vocab = shape.padded_vocab(t) * h / t
    params = stage_layer_count(shape, layout, stage) * layer_params_per_device(shape, t)
    tied = shape.block == "gpt2"
    # under zb-v device 0 holds both ends of the V, and the tied output layer is its embedding
    holds_output = stage == 0 if layout.v_placement and p > 1 else stage == p - 1
    if stage == 0:
        params += vocab + (shape.max_positions * h if tied else 0)
    if holds_output:
        params += (0 if tied and (p == 1 or layout.v_placement) else vocab) + (2 * h if tied else h)
    return params


def stage_params(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """Weights on the first and on the last pipeline device (embeddings, output layer, norms)."""
    return stage_param_count(shape, layout, 0), stage_param_count(shape, layout, layout.pp - 1)


def layer_activation_bytes(shape: ModelShape, layout: Layout, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022 bytes kept per layer per micro-batch, for any f and block.

    A RoPE block (llama) keeps more attention tensors than Q, K and V: q, k and v are views of the
    QKV projection's output (models/layers.py ``split_qkv``), RoPE returns new q and k, and the
    attention saves those and v, whose view keeps the whole (h + 2 kv) output alive: h + kv more
    per token than Korthikanti's count, on every device. Context parallelism splits the sequence:
    every term is divided by cp.
    """
    s, b, h = shape.seq_length, layout.micro_batch_size, shape.hidden_size
    t, sp, c = layout.tp, layout.sequence_parallel, layout.cp
    recompute = recompute or layout.recompute
    sbh = s * b * h / c
    e, masks = shape.activation_bytes, ACT_MASK_BYTES if shape.dropout else 0
    if recompute == "full":
        return e * sbh / (t if sp else 1)
    replicated = ACT_TENSORS_REPLICATED * e + 2 * masks          # 10 in bf16 with dropout
    attn = ACT_TENSORS_SPLIT_ATTN - 2 + 2 * shape.kv_hidden / h  # Q, K, V, projection input
    if shape.block in ROPE_BLOCKS:  # RoPE's new q and k beside the whole QKV output (V's base)
        attn += (h + shape.kv_hidden) / h
    split = (attn * e * sbh                                      # 8 without GQA
             + ACT_TENSORS_MLP[shape.block] * e * s * b * shape.ffn_hidden_size / c)  # 4 or 6 per sbf
    base = (replicated * sbh + split) / t if sp else replicated * sbh + split / t
    if recompute == "selective":
        return base
    return base + scores_activation_bytes(shape, layout)


def scores_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """The attention scores' share (5 a s^2 b / t bytes), zero with fused attention."""
    if shape.fused_attention:
        return 0.0
    s, e = shape.seq_length, shape.activation_bytes
    per = e + (ACT_MASK_BYTES + e if shape.dropout else 0)  # 5 in bf16 with dropout
    return per * shape.num_attention_heads * s * s * layout.micro_batch_size / layout.tp


def in_flight(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline device holds at its peak (Megatron's warm-up;
    GPipe all m;
    zero-bubble schedules count a micro-batch until its W, the weight gradients needing the
    layers' inputs: zb-h1 min(p, m) on every device, zb-v the schedule's own peak of half-stage
    chunks, p stages' worth once m >= 2p - 1)."""
    p, v, m = layout.pp, layout.vp, num_micro_batches(shape, layout)
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":   # every forward before the first backward
        return float(m)
    if layout.schedule == "zb-h1":
        return float(min(p, m))
    if layout.schedule == "zb-v":
        from parallel.pipeline.schedules import build_schedule, in_flight_peaks
        return in_flight_peaks(build_schedule("zb-v", p, min(m, 2 * p)))[stage] / 2
    if v == 1:
        return float(min(p - stage, m))
    return min(((p - stage - 1) * 2 + (v - 1) * p + 1) / v, float(m))


def communicators(layout: Layout, tied_embeddings: bool, stage: str = "first",
                  moe: bool = False) -> tuple[int, int]:
    """(collective communicators, point-to-point neighbour pairs) of a device of the "first",
    "middle" or "last" stage: one per process group of more than one rank that issues a
    collective (world, tp, cp, dp or, when cp > 1, dp x cp, pp, and the tied-embedding pair of
    the first and last stages; the training step sums the gradient norm in its statistics
    all-reduce over the world, so the mp = tp x pp group issues none; with compression, the
    exchange worker's own dp x cp communicator, parallel/runtime/lanes.py; with ``moe``, a stage
    holding MoE layers, and ep > 1 the EP group's all-to-alls and the EDP group's expert gradient
    reduction), and, with pp > 1, its
    pipeline neighbours (one at either end; two for a middle stage, and at the ends when the
    interleaved schedule wraps the last stage around to the first and pp > 2).

    >>> communicators(Layout(tp=2, pp=2, dp=2), tied_embeddings=True)  # world tp dp pp embedding
    (5, 1)
    >>> communicators(Layout(tp=2, pp=2, dp=2, compression=True), tied_embeddings=True)
    (6, 1)
    """
    t, c, p, d = layout.tp, layout.cp, layout.pp, layout.dp
    # with cp > 1 gradients are reduced over dp x cp: the DP group alone carries no collective;
    # under zb-v the tied pair is one device: its group is never used, so never created
    paired = p > 1 and tied_embeddings and stage != "middle" and not layout.v_placement
    groups = [layout.world_size, t, c, d if c == 1 else 1, d * c if c > 1 else 1, p,
              2 if paired else 1, d * c if layout.compression else 1]
    if moe and layout.ep > 1:
        groups += [layout.ep, layout.edp]
    neighbours = 0 if p == 1 else (2 if (layout.vp > 1 or stage == "middle") and p > 2 else 1)
    return sum(1 for size in groups if size > 1), neighbours


def buffer_bytes(collective: int, p2p: int, backend: str) -> float:
    """What ``backend`` reserves for ``collective`` communicators and ``p2p`` pipeline neighbours."""
    return collective * COMM_BUFFER_BYTES.get(backend, 0) + p2p * P2P_BUFFER_BYTES.get(backend, 0)


def comm_buffer_bytes(layout: Layout, backend: str, tied_embeddings: bool, stage: str = "first",
                      moe: bool = False) -> float:
    """Bytes the communication library reserves on one device for its communicators."""
    return buffer_bytes(*communicators(layout, tied_embeddings, stage, moe), backend)


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on one device, by part. A new part is a new field (and its line in memory_per_device)."""
    weights: float  # bf16 parameters (ZeRO-3: this rank's 1/(dp*cp) shards, experts 1/edp)
    grads: float  # fp32 main gradients (ZeRO-2/3: 1/(dp*cp) shards)
    optimizer: float  # fp32 master weights, Adam m and v (ZeRO: a shard; offload: the device's part)
    activations: float  # the layers' saved activations x micro-batches in flight
    transient: float  # one layer rebuilt by recomputation; the allgather dispatcher's combine sum
    pipeline_ends: float  # embedding dropout mask (first stage), final norm + fp32 logits (last)
    comm_buffers: float = 0.0  # HCCL / NCCL communicator buffers (comm_buffer_bytes)
    fp8: float = 0.0  # --fp8-format: one GEMM's float8 copies and the scales kept for backward (fp8.py)
    gathered: float = 0.0  # ZeRO-3: the whole units gathered at once, at their peak (zero3.py)
    compression: float = 0.0  # gradient compression's error-feedback residuals (compression_bytes)
    stage: str = "only"  # which device this is: "only" (pp = 1), "first" or "last"

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "stage")

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def optimizer_bytes_per_param(shape: ModelShape, layout: Layout, expert: bool = False) -> float:
    """fp32 master, Adam m and v per weight (an fp32 weight is its own master, also under ZeRO:
    parallel/dp/master.py), split under ZeRO over the dp x cp ranks, or for an ``expert`` weight
    over its expert-data-parallel group (dp x cp / ep ranks)."""
    per_weight = OPTIMIZER_STATE_BYTES - (4 if shape.weight_bytes == 4 else 0)
    if layout.zero:
        return per_weight / (layout.edp if expert else layout.dp * layout.cp)
    return per_weight


def compression_bytes(layout: Layout, dense: float, expert: float = 0.0) -> float:
    """Bytes the gradient compressors keep between steps for ``dense`` and ``expert`` weights
    (``Layout.compression``; parallel/dp/compression.py, counted in the run's
    optimizer_state_bytes): every compressed bucket's fp32 error-feedback ``residual`` (4 bytes a
    weight) and, without ZeRO, the owner's residual of its 1/p shard (4/p bytes; p = dp x cp, for
    expert weights their EDP group's ranks), which ZeRO's reduce-scatter does not keep. Not
    counted: the momentum compressors' (topk, onebit) fp32 momentum and its previous copy, which
    exist only once compression runs after its warm-up (at most 8 bytes a weight more), and a
    policy's that leaves some weights uncompressed (``Layout.compress_all`` False: none counted)."""
    if not (layout.compression and layout.compress_all):
        return 0.0
    owner = (lambda p: 0.0) if layout.zero else (lambda p: 4.0 / p)  # noqa: E731
    return dense * (4 + owner(layout.dp * layout.cp)) + \
        (expert * (4 + owner(max(layout.edp, 1))) if expert else 0.0)


def moe_activation_change(shape: ModelShape, layout: Layout, recompute: str | None = None) -> float:
    """Bytes an MoE layer keeps per micro-batch beyond the dense layer it replaces (negative when
    it keeps less): the dense MLP's ``n e s b f / t`` is replaced by the experts' ``e T K`` rows
    (their gathered input and their outputs, which the weighted combine keeps,
    ``ACT_MOE_ROWS e T K h``, E C rows padded to capacity; ``n e T K f_e / etp`` inside them, n as the dense MLP's: under
    expert tensor parallelism each TP rank keeps its slice of the experts' width), the shared
    expert's ``n e T f_s / t``, the router's fp32 logits and scores (``ACT_MOE_FP32_PER_EXPERT``
    x 4 T E; its fp32 copy of the input 4 T h when activations are not fp32) and the routing's
    index vectors (``ACT_MOE_INDEX_BYTES`` per assignment), T = s b (the rows and indices of
    the TP group's gathered tokens under ETP with SP, ``moe_expert_tokens``); the allgather
    dispatcher's sort of every EP rank's assignments (``moe_allgather.kept_bytes``). Full
    recomputation keeps only the layer's input: no change."""
    recompute = recompute or layout.recompute
    if shape.moe is None or recompute == "full":
        return 0.0
    moe, h, e, t = shape.moe, shape.hidden_size, shape.activation_bytes, layout.tp
    tokens = shape.seq_length * layout.micro_batch_size / layout.cp
    n = ACT_TENSORS_MLP[shape.block]
    routed = moe_tokens(shape, layout)   # this TP rank's own under sequence parallelism
    assignments = moe_expert_tokens(shape, layout) * moe.topk   # the TP group's under ETP + SP
    rows = moe_expert_rows(shape, layout)   # E C of them padded to capacity
    kept = (e * rows * (ACT_MOE_ROWS * h + n * moe.ffn_hidden / layout.etp)
            + n * e * tokens * moe.shared_ffn / t
            + 4 * routed * (ACT_MOE_FP32_PER_EXPERT * moe.num_experts + (h if e != 4 else 0))
            + ACT_MOE_INDEX_BYTES * assignments + moe_allgather.kept_bytes(shape, layout))
    return kept - n * e * tokens * shape.ffn_hidden_size / t


def stage_name(layout: Layout, stage: int) -> str:
    if layout.pp == 1:
        return "only"
    return "first" if stage == 0 else "last" if stage == layout.pp - 1 else "middle"


def stage_memory(shape: ModelShape, layout: Layout, stage: int, backend: str = "gloo") -> MemoryTerms:
    """Bytes on a device of pipeline rank ``stage``; ``backend`` (hccl, nccl, gloo) prices the
    communicator buffers."""
    s, b, h, t, c = shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp, layout.cp
    shards = layout.dp * c if layout.zero else 1
    dense, expert = stage_param_split(shape, layout, stage)
    params = dense + expert
    layers = stage_layer_count(shape, layout, stage)
    moe_layers = stage_moe_layers(shape, layout, stage)
    transient = {"full": layer_activation_bytes(shape, layout, "none"),
                 "selective": scores_activation_bytes(shape, layout),
                 "none": 0.0}[layout.recompute]
    shard = t if layout.sequence_parallel else 1
    # the embedding's dropout mask, per micro-batch in flight (none without dropout)
    embedding = s * b * h / c / shard * (ACT_MASK_BYTES if shape.dropout else 0)
    # the final norm's input (a sequence shard under SP), the output layer's (gathered whole under
    # SP: models/output.py's linear saves the all-gathered input) and the fp32 logits
    e = shape.activation_bytes
    logits = (e * s * b * h / shard + e * s * b * h + 4 * s * b * shape.padded_vocab(t) / t) / c
    name = stage_name(layout, stage)
    if layout.schedule == "gpipe":   # every forward first: the last stage keeps each one's logits
        logits *= in_flight(shape, layout, stage)
    ends = {"only": embedding + logits, "first": embedding * in_flight(shape, layout, 0),
            "last": logits, "middle": 0.0}[name]
    if layout.v_placement and layout.pp > 1:  # device 0: the embedding and the output layer
        ends = {"first": embedding * in_flight(shape, layout, 0) + logits}.get(name, 0.0)
    zero2 = layout.grads_sharded
    grads = dense * (GRAD_BYTES / (shards if zero2 else 1)) + \
        expert * (GRAD_BYTES / (layout.edp if zero2 else 1))
    optimizer = dense * optimizer_bytes_per_param(shape, layout)
    if expert:
        optimizer += expert * optimizer_bytes_per_param(shape, layout, expert=True)
    optimizer *= 1.0 - layout.offload   # the rest in host memory (offload.py)
    weights, gathered = params * shape.weight_bytes, 0.0
    if layout.zero3:   # the persistent shards, and the units gathered at once (zero3.py)
        weights = shape.weight_bytes * (dense / shards + (expert / layout.edp if expert else 0.0))
        gathered = gathered_bytes(shape, layout, stage)
    per_micro = layers * layer_activation_bytes(shape, layout)
    if moe_layers:
        per_micro += moe_layers * moe_activation_change(shape, layout)
        if layout.recompute == "full":  # the rebuilt layer is an MoE one
            transient += moe_activation_change(shape, layout, "none")
        # the allgather dispatcher's fp32 sum over every EP rank's tokens (its gradient backward)
        transient += moe_allgather.transient_bytes(shape, layout)
    fp8_layers = stage_fp8_layers(shape, layout, stage)
    fp8 = 0.0 if not fp8_layers else (fp8_gemm_copy_bytes(shape, layout) + fp8_layers
                                      * fp8_scale_bytes(shape, layout) * in_flight(shape, layout, stage))
    return MemoryTerms(weights, grads, optimizer, per_micro * in_flight(shape, layout, stage),
                       transient, ends,
                       comm_buffer_bytes(layout, backend, shape.block == "gpt2", name, moe_layers > 0),
                       fp8, gathered, compression_bytes(layout, dense, expert), name)


def memory_per_device(shape: ModelShape, layout: Layout, backend: str = "gloo") -> MemoryTerms:
    """Bytes on the most loaded pipeline device (the first or the last; with MoE layers any);
    ``backend`` (hccl, nccl, gloo) prices the communicator buffers."""
    first = stage_memory(shape, layout, 0, backend)
    if layout.pp == 1:
        return first
    # with MoE layers a middle stage can hold the most experts (--moe-layer-freq), and with
    # --stage-end-weight the most layers
    others = range(1, layout.pp) if shape.moe is not None or layout.stage_end_weight \
        else (layout.pp - 1,)
    return max([first] + [stage_memory(shape, layout, s, backend) for s in others],
               key=lambda mem: mem.total)
