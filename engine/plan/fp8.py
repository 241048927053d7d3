"""FP8 in the planner (``--fp8-format``, docs/precision.md): the rate of the tensor-parallel
linears' GEMMs and the memory of their float8 copies and scales.

Time: under FP8 the linears' GEMMs (QKV, attention output, MLP in and out, the shared expert's; forward
and both backward GEMMs) and the MoE experts' grouped GEMMs run at the chip's dense FP8 peak
(``DeviceSpec.fp8_tflops``) times the FP8 achievable fraction (``Cluster.fp8_fraction``: the bf16
fraction until ``--calibrate`` fits it to an FP8 run). The attention core, the output layer and
the MoE router stay at the bf16 rate, as the engine runs them.

Memory (one TP rank, T = s b / cp tokens per GEMM: under sequence parallelism the column-parallel
input is gathered and the row-parallel output scattered after the GEMM, so every GEMM sees T):

- copies, transient, one GEMM at a time: the largest of a layer's linears (in, out) of
  ``fp8_gemm_copy_bytes``: the weight gradient holds dy and x in float8 and each once more in the
  layout torch._scaled_mm takes (dy^T row-major, x column-major), 2 T (in + out) bytes; the input
  gradient dy, W and W's column-major copy, T out + 2 in out bytes; with MoE layers also the
  experts' projections (``expert_copy_bytes``);
- scales kept from forward to backward (parallel/tensor_parallel/fp8.py keeps nothing else: backward
  quantizes again from the saved bf16 tensors), fp32, per layer and micro-batch in flight:
  tensorwise one for x and one per weight of each linear; rowwise at most one per token of x and
  one per output row of W; blockwise one per 128 x 128 block of each weight (``fp8_scale_bytes``).

Blockwise scales are each tile's own (kernels/fp8_blockwise.py): no amax is reduced over a group
(``amax_bytes`` counts none for the linears; the experts keep their rowwise reductions). A layout
whose TP or CP shards would cut a 128 tile is one engine.train refuses: the command line gives the
trainer's own rule as one of ``ModelShape.rules``, which model.check_layout applies.
"""
from __future__ import annotations

import math

from engine.plan.model import Cluster, Layout, ModelShape, moe_expert_tokens

FP8_BYTES = 1      # a float8 element
SCALE_BYTES = 4    # an fp32 scale
BLOCK = 128        # a blockwise tile (kernels/fp8_blockwise.py)


def linear_rate(cluster: Cluster, shape: ModelShape) -> float:
    """FLOP/s of the tensor-parallel linears' GEMMs: FP8 peak x FP8 fraction under FP8, else the
    bf16 peak x the achievable fraction (passes._rates)."""
    if shape.fp8_recipe is None:
        return cluster.peak_tflops * 1e12 * cluster.achievable_fraction
    if cluster.fp8_peak_tflops is None:
        raise ValueError(f"--fp8-format: {cluster.device.name} has no FP8 peak in "
                         f"engine/plan/hardware.py (FP8 needs compute capability 8.9 or later); "
                         f"give --fp8-peak-tflops or drop --fp8-format")
    return cluster.fp8_peak_tflops * 1e12 * cluster.fp8_fraction


def layer_linears(shape: ModelShape, tp: int) -> list[tuple[float, float, int]]:
    """(in, out, weights) of each tensor-parallel linear call of a layer on one TP rank: QKV,
    attention output, MLP in (llama: gate and up, two weights on one input), MLP out."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_hidden
    gated = shape.block == "llama"
    return [(h, (h + 2 * kv) / tp, 1), (h / tp, h, 1), (h, (2 if gated else 1) * f / tp, 2 if gated else 1),
            (f / tp, h, 1)]


def _tokens(shape: ModelShape, layout: Layout) -> float:
    return shape.seq_length * layout.micro_batch_size / layout.cp


def fp8_gemm_copy_bytes(shape: ModelShape, layout: Layout) -> float:
    """The float8 copies alive during a layer's largest FP8 GEMM (transient; module docstring)."""
    if shape.fp8_recipe is None:
        return 0.0
    T = _tokens(shape, layout)
    linears = FP8_BYTES * max(max(2 * T * (i + o), T * o + 2 * i * o)
                              for i, o, _ in layer_linears(shape, layout.tp))
    return linears if shape.moe is None else max(linears, expert_copy_bytes(shape, layout))


def expert_copy_bytes(shape: ModelShape, layout: Layout) -> float:
    """The float8 copies alive during the largest of an MoE layer's experts' FP8 GEMMs (transient;
    kernels/fp8_grouped.py), N = the balanced rows of the rank's E/ep experts, per projection
    (in, out) on one ETP rank: the weight gradient holds dy and x in float8, zero-padded by segment
    and in the operand layouts, about 3 N (in + out) bytes, and under EP the per-source products
    (E, out, in) in bf16 before their sum (the grouped kernel's output); the input gradient dy, W
    and W's column-major copy, N out + 2 E/ep in out. Not counted: the eager quantization's fp32
    transient of the tensor it quantizes."""
    moe = shape.moe
    h, f = shape.hidden_size, moe.ffn_hidden / layout.etp
    rows, local = moe_expert_tokens(shape, layout) * moe.topk, moe.num_experts / layout.ep
    f_in = (2 if shape.block == "llama" else 1) * f
    per_source = 2 * moe.num_experts if layout.ep > 1 else 0.0
    return max(max(FP8_BYTES * 3 * rows * (i + o) + per_source * i * o,
                   FP8_BYTES * (rows * o + 2 * local * i * o))
               for i, o in ((h, f_in), (f, h)))


def fp8_scale_bytes(shape: ModelShape, layout: Layout) -> float:
    """fp32 scales one layer keeps per micro-batch from forward to backward."""
    if shape.fp8_recipe is None:
        return 0.0
    linears = layer_linears(shape, layout.tp)
    if shape.fp8_recipe == "tensorwise":
        return SCALE_BYTES * sum(1 + n for _, _, n in linears)
    if shape.fp8_recipe == "blockwise":
        return SCALE_BYTES * sum(n * math.ceil(i / BLOCK) * math.ceil(o / n / BLOCK)
                                 for i, o, n in linears)   # o: the call's n weights together
    T = _tokens(shape, layout)
    return SCALE_BYTES * sum(T + o for _, o, _ in linears)


def _layer_calls(shape: ModelShape, layout: Layout, mlp_width: int) -> list[tuple[str, int, float, float]]:
    """(kind, weights, in, out per weight) of each FP8 linear call of a layer on one TP rank, in
    forward order: QKV (column), attention output (row), and with an MLP of ``mlp_width`` (0: an
    MoE layer without a shared expert) its input, column (llama: gate and up, one call on a
    gathered sequence shard, two calls otherwise: parallel/tensor_parallel/layers.py
    ``column_parallel_linears``), and its output (row)."""
    h, t = shape.hidden_size, layout.tp
    calls = [("col", 1, h, (h + 2 * shape.kv_hidden) / t), ("row", 1, h / t, h)]
    if mlp_width:
        if shape.block != "llama":
            calls.append(("col", 1, h, mlp_width / t))
        elif layout.sequence_parallel and t > 1:
            calls.append(("col", 2, h, mlp_width / t))
        else:
            calls += [("col", 1, h, mlp_width / t)] * 2
        calls.append(("row", 1, mlp_width / t, h))
    return calls


def _call_amaxes(kind: str, n: int, i: float, o: float, tokens: float, shard: bool, ring: bool,
                 rowwise: bool) -> tuple[float, float, float, float]:
    """fp32 amaxes one call reduces (forward TP, forward CP, backward TP, backward CP), as
    parallel/tensor_parallel/fp8.py's ``Fp8Forward`` and ``Fp8Backward`` name them (module
    docstring of amax_bytes): ``shard``, the column input held as a sequence shard (sequence
    parallelism); ``ring``, the row output's gradient too (the --tp-comm-overlap ring)."""
    if not rowwise:
        if kind == "col":   # x over CP (and TP when a gathered shard), W over TP; dy over both
            return shard + n, 1, n, n
        return 1 + n, 1, n if ring else 0, n   # x over both, W over TP; dy over CP (TP: ring)
    if kind == "col":   # per token: nothing forward; backward dy's per token over TP, its
        #                 columns over CP, W's input columns over TP, x's features over CP (TP)
        return 0, 0, n * tokens + n * i + (i if shard else 0), n * o + i
    #  row: forward x per token and W per output row over TP; backward dy's columns over CP
    #  (TP: ring), x's features over CP
    return tokens + n * o, 0, n * o if ring else 0, n * o + i


def amax_bytes(shape: ModelShape, layout: Layout,
               moe_layer: bool = False) -> tuple[float, float, float]:
    """(TP bytes, CP bytes, EDP bytes) of the MAX all-reduces of one FP8 layer per micro-batch (0s
    without FP8): what the engine adds to tp_comm_bytes, cp_comm_bytes and (the experts' EDP
    group under EP with CP) dp_comm_bytes to agree on scales over the
    logical tensors (docs/precision.md). Per layer call one all-reduce per group (TP, then CP) of
    the fp32 amaxes that name it:

    - tensorwise: forward x's (its groups: CP, and TP where it is a sharded row-parallel input or
      a gathered sequence shard) and every weight's (TP); backward the output gradients' (CP; TP
      for a column-parallel output, or a row-parallel one gathered in the ring);
    - rowwise: per token (of T = s b / cp) where the features are split over TP, per feature
      where the tokens are split (CP; TP for a gathered shard), per weight row or column where
      the other axis is split (``_call_amaxes``).

    A full recomputation repeats every call's forward, the MLP output's too: torch's checkpoint
    stops early only once the call's autograd Function has returned and its saved input is
    packed, after the Function's forward reduced its amaxes (what early stop leaves out is the
    collective after it). An MoE layer's MLP calls are its shared expert's (none without one),
    plus its experts' (``expert_amaxes``)."""
    if shape.fp8_recipe is None:
        return 0.0, 0.0, 0.0
    t, c = layout.tp, layout.cp
    width = (shape.moe.shared_ffn if moe_layer else shape.ffn_hidden_size)
    shard = layout.sequence_parallel and t > 1
    ring = shard and layout.tp_comm_overlap
    tokens = _tokens(shape, layout)
    forwards = 2 if layout.recompute == "full" else 1
    tp = cp = 0.0
    for kind, n, i, o in _layer_calls(shape, layout, width):
        if shape.fp8_recipe == "blockwise":   # each tile's own scale: nothing reduced
            continue
        f_tp, f_cp, b_tp, b_cp = _call_amaxes(kind, n, i, o, tokens, shard, ring,
                                              shape.fp8_recipe == "rowwise")
        tp += forwards * f_tp + b_tp
        cp += forwards * f_cp + b_cp
    edp = 0.0
    if moe_layer:
        f_tp, b_tp, b_cp, edp = expert_amaxes(shape, layout)
        tp += forwards * f_tp + b_tp
        cp += b_cp
    return (SCALE_BYTES * tp if t > 1 else 0.0, SCALE_BYTES * cp if c > 1 else 0.0,
            SCALE_BYTES * edp)


def expert_amaxes(shape: ModelShape, layout: Layout) -> tuple[float, float, float, float]:
    """fp32 amaxes an MoE layer's experts reduce per micro-batch (forward TP, backward TP, backward
    CP, backward EDP), as kernels/fp8_grouped.py's ``Fp8GroupedForward`` / ``Fp8GroupedBackward`` name them
    (models/moe/experts.py ``fp8_spec``), with N = the rows the rank's E/ep experts compute (the
    balanced T K of the tokens it computes, ``moe_expert_tokens``) and f = the expert width / etp:

    - ETP (the TP group): fc2's forward, each row's amax over its f features and each weight
      row's, N + E/ep h; fc1's backward, each gradient row's over f (2 f gated) and each weight
      column's, N + E/ep h;
    - the weight gradients' column amaxes per (local expert, source) segment (E/ep experts times
      ep sources: E segments), fc2's over h and f, fc1's over 2 f (gated) or f and h, reduced
      over TP under sequence parallelism without ETP and over CP at ep 1; with ep > 1 under CP
      they are reduced per (local expert, micro-batch) instead (``SegmentSlots``: E/ep times dp
      slots), over TP as before and over EDP where it has more than one rank."""
    moe = shape.moe
    h, etp = shape.hidden_size, layout.etp
    f = moe.ffn_hidden / etp
    f_in = (2 if shape.block == "llama" else 1) * f
    rows = moe_expert_tokens(shape, layout) * moe.topk
    sharded = rows + moe.num_experts / layout.ep * h if etp > 1 else 0.0
    slots = layout.cp > 1 and layout.ep > 1
    segments = moe.num_experts // layout.ep * layout.dp if slots else moe.num_experts
    columns = segments * (2 * h + f + f_in)
    tp = columns if layout.sequence_parallel and layout.tp > 1 and etp == 1 else 0.0
    cp = columns if layout.cp > 1 and layout.ep == 1 else 0.0
    edp = columns if slots and layout.dp * layout.cp > layout.ep else 0.0
    return sharded, sharded + tp, cp, edp
