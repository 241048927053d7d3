"""Token dispatch of a mixture-of-experts layer over its expert-parallel group by all-gather
(``--moe-token-dispatcher-type allgather``, as Megatron-LM's MoEAllGatherTokenDispatcher).

One layer's forward, T tokens of width h on each rank, each routed to K of E experts, the EP
group of P ranks holding E/P experts each (rank j: experts [j E/P, (j+1) E/P))::

    allgather_dispatch  the routing first: each rank's assignment table is all-gathered (int32;
                        dropless or with unpadded capacity the expert of each of its T K
                        assignments, E for a dropped one; padded to capacity C, the assignment in
                        each of the E C slots, -1 for padding); then the tokens (T, h) -> (P T, h)
                        and the router weights (T, K) -> (P T, K), each by an all-gather whose
                        backward is a reduce-scatter. Each rank keeps the assignments to its local
                        experts, sorted by (local expert, source rank, token): the same rows in the
                        same order as the alltoall dispatcher gives its experts.
    ... the experts run on contiguous row segments ...
    allgather_combine   each row times its router weight, summed per gathered token into (P T, h)
                        on this rank, then reduce-scattered back to the tokens' owners: (T, h), the
                        weighted sum over the token's K experts (the sum in the weights' dtype, fp32
                        with the router's fp32 weights, as ``unpermute_tokens`` sums)

The layer hands over its ``Permutation`` (permute.py: ``permute_tokens`` or ``permute_padded``,
built on a zero-width view of the tokens, so no rows are copied): its ``order``, ``counts`` and
``mask`` say which assignments are kept (with an unpadded capacity the dropped ones sort after
every expert). Every rank receives every token of the group, which costs (P - 1) T h per rank
where the alltoall dispatcher moves about (P - 1)/P T K h, and no count exchange. Dropless and with
unpadded capacity the number of rows this rank's experts receive is read on the host (the one host
wait, through ``HostReader``'s pinned copy, started as soon as the routing tables are gathered and
waited for after the token all-gathers are queued); the local experts' row offsets stay on the
device; padded to capacity nothing is read. Every collective goes through ``CommGroup`` (kind
``ep``): the backend rules check it and ``ep_comm_bytes`` counts it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.runtime.comm import CommGroup
from parallel.expert_parallel.host_read import HostReader, PendingRead, dynamic_rows
from parallel.expert_parallel.permute import (Permutation, _WeightedScatterAddForwardGatherBackward,
                                              count_per_expert, equal_counts, gather_rows,
                                              offsets_of, passenger_scale)


class _AllGatherForwardReduceScatterBackward(torch.autograd.Function):
    """Every rank's (n, ...) concatenated along dim 0 (P n, ...); the gradient of each rank's piece
    is the sum over ranks of their gradients for it."""

    @staticmethod
    def forward(ctx, x, group: CommGroup):  # (n, ...)
        ctx.group = group
        out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
        group.all_gather_into(out, x.contiguous())
        return out  # (P n, ...)

    @staticmethod
    def backward(ctx, grad):  # (P n, ...)
        group = ctx.group
        out = grad.new_empty((grad.shape[0] // group.size, *grad.shape[1:]))
        group.reduce_scatter_into(out, grad.contiguous())
        return out, None


class _ReduceScatterForwardAllGatherBackward(torch.autograd.Function):
    """The sum over ranks of (P n, ...), this rank keeping its piece (n, ...); the gradient of the
    whole is every rank's piece gradient, gathered."""

    @staticmethod
    def forward(ctx, x, group: CommGroup):  # (P n, ...)
        ctx.group = group
        out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
        group.reduce_scatter_into(out, x.contiguous())
        return out  # (n, ...)

    @staticmethod
    def backward(ctx, grad):  # (n, ...)
        group = ctx.group
        out = grad.new_empty((group.size * grad.shape[0], *grad.shape[1:]))
        group.all_gather_into(out, grad.contiguous())
        return out, None


def all_gather_rows(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """(n, ...) -> (P n, ...) in rank order; backward reduce-scatters. One rank: x itself."""
    return x if group.size == 1 else _AllGatherForwardReduceScatterBackward.apply(x, group)


def reduce_scatter_rows(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """(P n, ...) summed over the group -> this rank's (n, ...); backward all-gathers."""
    return x if group.size == 1 else _ReduceScatterForwardAllGatherBackward.apply(x, group)


def _gather_table(table: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """All-gather an int32 routing table (no gradient)."""
    if group.size == 1:
        return table
    out = table.new_empty((group.size * table.shape[0], *table.shape[1:]))
    group.all_gather_into(out, table.contiguous())
    return out


@dataclass
class AllGatherState:
    """What ``allgather_combine`` needs: each expert row's gathered token (N,) into the P T
    gathered tokens, its router weight (N,) (0 for a padding row), P T, and the local experts'
    row offsets (E/P,) on the device."""
    tokens: torch.Tensor
    weights: torch.Tensor
    num_gathered: int
    offsets: torch.Tensor
    groups: torch.Tensor | None = None  # (N,) each row's local expert (a dropped copy: the last)
    # (E/P P,) int32: the row end of each (local expert, source rank) segment, the kept rows only
    # (FP8's weight gradient takes its column scales per source, kernels/fp8_grouped.py)
    segments: torch.Tensor | None = None


def allgather_dispatch(x: torch.Tensor, weights: torch.Tensor, perm: Permutation,
                       group: CommGroup, capacity: int | None = None,
                       reader: HostReader | None = None, segments: bool = True):
    """(T, h) tokens, (T, K) router weights and the layer's Permutation -> (N, h) rows of this
    rank's experts sorted by (local expert, source rank, token), and the state. ``capacity``: the
    Permutation is padded to exactly that many slots per expert (``permute_padded``).
    ``segments``: count the (local expert, source rank) segments (FP8's weight gradient; off, the
    state's ``segments`` is None and the count is not made)."""
    p, rank = group.size, group.rank
    t, k = weights.shape
    e = perm.counts.numel()
    local = e // p
    lo = rank * local
    device = x.device
    if capacity is None:
        # every assignment's expert (E: dropped), in flat (T K) order; the dropped sort last
        counts = torch.cat([perm.counts, (t * k - perm.counts.sum()).view(1)])   # (E + 1,)
        table = torch.empty(t * k, dtype=torch.int32, device=device)
        table[perm.order] = torch.repeat_interleave(
            torch.arange(e + 1, dtype=torch.int32, device=device), counts, output_size=t * k)
        dest = _gather_table(table, group).long() - lo                        # (P T K,)
        key = torch.where((dest >= 0) & (dest < local), dest, torch.full_like(dest, local))
        per_expert = count_per_expert(key, local + 1)[:local]                  # (E/P,) device
        per_source = None
        if segments:
            source = torch.div(torch.arange(p * t * k, device=device), t * k, rounding_mode="floor")
            per_source = count_per_expert(key * p + source, (local + 1) * p)[:local * p]  # (E/P P,)
        routed = read = None
        if p > 1:
            read = (reader or HostReader()).start(per_expert.sum().view(1))    # rows to take
    else:
        code = torch.where(perm.mask > 0, perm.order, torch.full_like(perm.order, -1)).int()
        table = _gather_table(code, group).long().view(p, e, capacity)[:, lo:lo + local]
        table = table.transpose(0, 1).reshape(-1)                          # (E/P P C,)
        source = torch.arange(p, device=device).view(1, p, 1).expand(local, p, capacity).reshape(-1)
        routed = table >= 0
        flat = source * (t * k) + table.clamp(min=0)                        # (N,) into P T K
        per_expert = equal_counts(local, p * capacity, device)
        per_source = equal_counts(local * p, capacity, device) if segments else None
    gathered_x = all_gather_rows(x, group)                                  # (P T, h)
    gathered_w = all_gather_rows(weights, group).reshape(-1)                # (P T K,)
    rows_end = groups = None
    if capacity is None and read is not None:
        groups, flat = _take_rows(read, key)                                # (N,) into P T K
    elif capacity is None:  # one rank: every copy, the dropped last (weight 0, the last group's)
        groups, flat = torch.sort(key, stable=True)
        routed, rows_end = groups < local, t * k
        groups = groups.clamp(max=local - 1)  # the dropped copies count in the last group
    tokens = torch.div(flat, k, rounding_mode="floor")                      # (N,) into P T
    row_weights = gathered_w.index_select(0, flat)                          # (N,)
    if routed is not None:
        row_weights = row_weights * routed
    rows = gather_rows(gathered_x, tokens)                                  # (N, h)
    return rows, AllGatherState(tokens, row_weights, p * t, offsets_of(per_expert, rows_end), groups,
                                None if per_source is None else offsets_of(per_source))


@torch.compiler.disable
def _take_rows(read: PendingRead, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The host read of this rank's row count N and the first N assignments sorted by (local
    expert, source rank, token): their local experts and flat indices (N,), eager under
    torch.compile and marked dynamic (host_read.py)."""
    n = read.values()[0]                                                    # the one host wait
    groups, flat = torch.sort(key, stable=True)
    groups, flat = groups[:n], flat[:n]
    dynamic_rows(groups, flat)
    return groups, flat


def allgather_combine(rows: torch.Tensor, state: AllGatherState, group: CommGroup,
                      loss: torch.Tensor | None = None, scale=1.0) -> torch.Tensor:
    """(N, h) expert outputs -> (T, h): weighted and summed per gathered token, then
    reduce-scattered to the tokens' owners. ``loss`` (0-d) rides along with gradient ``scale``
    (the layer's balancing losses, as ``unpermute_tokens`` takes them)."""
    scale = passenger_scale(loss, scale)
    out = _WeightedScatterAddForwardGatherBackward.apply(rows, state.weights, state.tokens,
                                                         state.num_gathered, loss, scale)  # (P T, h)
    return reduce_scatter_rows(out, group)                                    # (T, h)
