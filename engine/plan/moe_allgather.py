"""The allgather dispatcher (``--moe-token-dispatcher-type allgather``,
parallel/expert_parallel/allgather.py) in the planner: its collectives over the EP group, their
payload bytes (traffic.py) and seconds (moe_time.py), and what it keeps (memory.py).

One MoE layer and micro-batch on a rank of an EP group of P ranks, T = the tokens whose rows the
rank computes (``model.moe_expert_tokens``), K = top-k, h = hidden, e = bytes per activation
element. Every rank gathers every EP rank's tokens; the bytes do not depend on the routing::

    forward    all-gather of the routing table, int32: T K assignments (padded to capacity: the
               E C slots, C = ceil(F T K / E))                          4 T K   (4 E C)  a shard
               all-gather of the tokens (T, h)                          e T h            a shard
               all-gather of the router weights (T, K), fp32            4 T K            a shard
               reduce-scatter of the combined (P T, h), fp32 (the sum
               in the router weights' dtype)                            4 P T h
    backward   all-gather of the combine's gradient (T, h), fp32        4 T h            a shard
               reduce-scatter of the weights' gradient (P T, K), fp32   4 P T K
               reduce-scatter of the tokens' gradient (P T, h)          e P T h
    full       the forward's gathers again, and its reduce-scatter where the recomputation runs
    recompute  past it: a shared expert follows the combine, or no early stop (a residual
               dropout); otherwise the early stop ends the recomputation at the combine, whose
               output nothing saves

Payload as the engine's communication layer counts it (parallel/runtime/comm.py): an all-gather
its own shard, a reduce-scatter its whole input. Time: each a ring all-gather or reduce-scatter of
the whole (P x shard) buffer over the EP group's bus bandwidth (collectives.gather_or_scatter_s),
exposed as the all-to-alls are. With P = 1 nothing is sent.

Kept (per micro-batch in flight): the sorted indices of all P T K gathered assignments, int64,
which the router weights' gather keeps for its backward (dropless; padded to capacity it keeps the
E C rows' own, as the permutation's indices are counted); transient within the layer, forward and
backward: the fp32 (P T, h) sum of the combine and its gradient (``transient_bytes``), beside
which the gathered (P T, h) tokens are freed before the combine.
"""
from __future__ import annotations

from engine.plan.collectives import gather_or_scatter_s
from engine.plan.flops import expert_capacity
from engine.plan.model import ACT_MOE_GATHERED_INDEX_BYTES, Layout, ModelShape, moe_expert_tokens

FP32 = 4
INT32 = 4


def uses_allgather(shape: ModelShape) -> bool:
    return shape.moe is not None and shape.moe.dispatcher == "allgather"


def collectives(shape: ModelShape, layout: Layout) -> tuple[list, list, list]:
    """(forward, backward, recomputed forward) of one MoE layer and micro-batch: each a list of
    ("all_gather" | "reduce_scatter", whole buffer bytes) (the module docstring)."""
    moe, p, h, e = shape.moe, layout.ep, shape.hidden_size, shape.activation_bytes
    tokens = moe_expert_tokens(shape, layout)
    table = (moe.num_experts * expert_capacity(moe, int(tokens))
             if moe.padded_capacity_factor is not None else tokens * moe.topk)
    gathers = [("all_gather", p * INT32 * table), ("all_gather", p * e * tokens * h),
               ("all_gather", p * FP32 * tokens * moe.topk)]
    combine = ("reduce_scatter", FP32 * p * tokens * h)
    backward = [("all_gather", FP32 * p * tokens * h),
                ("reduce_scatter", FP32 * p * tokens * moe.topk),
                ("reduce_scatter", e * p * tokens * h)]
    redo = []
    if layout.recompute == "full":
        past = moe.shared_ffn or not shape.recompute_early_stop
        redo = gathers + ([combine] if past else [])
    return gathers + [combine], backward, redo


def _payload(calls: list, ranks: int) -> float:
    return sum(whole / ranks if op == "all_gather" else whole for op, whole in calls)


def payload_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes one rank hands to the dispatcher's collectives per MoE layer and micro-batch."""
    if layout.ep == 1:
        return 0.0
    return sum(_payload(calls, layout.ep) for calls in collectives(shape, layout))


def seconds(shape: ModelShape, layout: Layout, busbw_gbps: float) -> tuple[float, float, float]:
    """(forward, backward, recomputed forward) seconds of the dispatcher's collectives per MoE
    layer and micro-batch over the EP group's bus bandwidth; 0s at ep = 1."""
    if layout.ep == 1:
        return 0.0, 0.0, 0.0
    return tuple(sum(gather_or_scatter_s(whole, layout.ep, busbw_gbps) for _, whole in calls)
                 for calls in collectives(shape, layout))


def kept_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes the dispatcher keeps per MoE layer and micro-batch beyond the permutation's indices
    (memory.moe_activation_change): the sorted indices of every EP rank's assignments (dropless)."""
    if not uses_allgather(shape) or shape.moe.padded_capacity_factor is not None:
        return 0.0
    return ACT_MOE_GATHERED_INDEX_BYTES * layout.ep * moe_expert_tokens(shape, layout) * shape.moe.topk


def transient_bytes(shape: ModelShape, layout: Layout) -> float:
    """The combine's fp32 (P T, h) sum (backward: its gradient), alive within one MoE layer."""
    if not uses_allgather(shape):
        return 0.0
    return FP32 * layout.ep * moe_expert_tokens(shape, layout) * shape.hidden_size
