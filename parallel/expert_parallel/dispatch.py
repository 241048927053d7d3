"""Token dispatch of a mixture-of-experts layer over its expert-parallel group (alltoall).

One layer's forward, T tokens of width h on each rank, each routed to K of E experts, the EP
group of P ranks holding E/P experts each (rank j: experts [j E/P, (j+1) E/P))::

    permute_tokens      (T, h) -> (T K, h)  the K copies of each token, sorted by expert (stable:
                                            token order inside an expert), and the counts (E,)
    alltoall_dispatch   counts exchanged first (an equal-split all-to-all of (P, E/P)), then the
                        rows by all_to_all with per-rank split sizes; received rows re-sorted from
                        (source rank, local expert) to (local expert, source rank)
    ... the experts run on contiguous row segments ...
    alltoall_combine    the inverse: re-sort back, all-to-all back with the splits swapped
    unpermute_tokens    (T K, h) -> (T, h)  each copy times its router weight, summed per token

Each communication or data-movement pattern is one autograd.Function named by its forward and
backward pair, with a thin public function taking the group. Dropless: every row is sent; the
split sizes are read on the host (the one host sync the alltoall dispatcher needs). With a
capacity (models/moe/capacity.py), ``permute_tokens(..., keep=)`` leaves the dropped assignments
out (reading the kept count on the host), and ``permute_padded`` makes exactly ``capacity`` rows
per expert (padding rows weigh 0): ``alltoall_dispatch(..., capacity=C)`` then knows every split
without exchanging or reading counts, so the padded path has no host read at all.

The allgather dispatcher (allgather.py) reuses the row gather and the weighted scatter-add here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import CommGroup


class _GatherRowsForwardScatterAddBackward(torch.autograd.Function):
    """rows = x[index]; the gradient of x sums the gradients of its copies."""

    @staticmethod
    def forward(ctx, x, index):  # (T, h), (R,)
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)  # (R, h)

    @staticmethod
    def backward(ctx, grad):  # (R, h)
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows, grad.shape[1]))
        return out.index_add_(0, index, grad), None


class _WeightedScatterAddForwardGatherBackward(torch.autograd.Function):
    """out[index[r]] += rows[r] * weight[r]; backward gathers the token gradients per row."""

    @staticmethod
    def forward(ctx, rows, weight, index, num_tokens: int):  # (R, h), (R,), (R,)
        ctx.save_for_backward(rows, weight, index)
        out = rows.new_zeros((num_tokens, rows.shape[1]), dtype=torch.result_type(rows, weight))
        return out.index_add_(0, index, rows * weight.unsqueeze(1))  # (T, h)

    @staticmethod
    def backward(ctx, grad):  # (T, h)
        rows, weight, index = ctx.saved_tensors
        g = grad.index_select(0, index)  # (R, h)
        grad_rows = (g * weight.unsqueeze(1)).to(rows.dtype)
        grad_weight = (g * rows).sum(1).to(weight.dtype)
        return grad_rows, grad_weight, None, None


class _AllToAllVForwardAllToAllVBackward(torch.autograd.Function):
    """Rows ``in_splits[j]`` go to rank j; the gradient travels back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group: CommGroup, out_splits: list, in_splits: list):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        group.all_to_all_v(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.group.all_to_all_v(out, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return out, None, None, None


@dataclass
class Permutation:
    """Where the T K copies of a layer's tokens went: ``order`` sorts the flat (T K) assignments
    by expert, ``tokens`` is the token of each sorted row, ``counts`` the rows per expert (E,)."""
    order: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    num_tokens: int
    mask: torch.Tensor | None = None  # (R,) 1.0 for a routed row, 0.0 for padding (padded only)


def permute_tokens(x: torch.Tensor, experts: torch.Tensor, num_experts: int,
                   keep: torch.Tensor | None = None):
    """(T, h) tokens and (T, K) expert indices -> (R, h) rows sorted by expert, Permutation.
    Dropless R = T K; with ``keep`` (T, K) bool only the kept assignments (R read on the host)."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    if keep is None:
        order = torch.argsort(flat, stable=True)  # (T K,): expert-major, token order inside
        counts = torch.bincount(flat, minlength=num_experts)
    else:  # dropped assignments sort after every expert and are cut off
        sent = torch.where(keep.reshape(-1), flat, torch.full_like(flat, num_experts))
        counts = torch.bincount(sent, minlength=num_experts + 1)[:num_experts]
        order = torch.argsort(sent, stable=True)[:int(keep.sum())]
    tokens = torch.div(order, k, rounding_mode="floor")
    rows = _GatherRowsForwardScatterAddBackward.apply(x, tokens)
    return rows, Permutation(order, tokens, counts, t)


def permute_padded(x: torch.Tensor, tokens: torch.Tensor, flat_index: torch.Tensor,
                   mask: torch.Tensor, capacity: int):
    """Padded to capacity: ``tokens``, ``flat_index`` (into the (T K) assignments) and ``mask``
    (E C,) give each expert's C rows in order -> (E C, h) rows and the Permutation."""
    e = tokens.numel() // capacity
    counts = torch.full((e,), capacity, dtype=torch.long, device=x.device)
    rows = _GatherRowsForwardScatterAddBackward.apply(x, tokens)
    return rows, Permutation(flat_index, tokens, counts, x.shape[0], mask)


def unpermute_tokens(rows: torch.Tensor, weights: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """(R, h) expert outputs in the permuted order, (T, K) router weights -> (T, h)."""
    w = weights.reshape(-1).index_select(0, perm.order)  # (R,) in the rows' order
    if perm.mask is not None:
        w = w * perm.mask
    return _WeightedScatterAddForwardGatherBackward.apply(rows, w, perm.tokens, perm.num_tokens)


@dataclass
class DispatchState:
    """What ``alltoall_combine`` needs to invert a dispatch."""
    in_splits: list
    out_splits: list
    order: torch.Tensor | None       # sorts the received rows by local expert
    tokens_per_expert: list          # rows of each local expert after the dispatch


def alltoall_dispatch(rows: torch.Tensor, counts: torch.Tensor, group: CommGroup,
                      capacity: int | None = None):
    """Send each expert's rows to the EP rank holding it. ``rows`` (R, h) sorted by expert and
    ``counts`` (E,) -> (N, h) rows of this rank's experts, sorted by local expert, and the state.
    ``capacity``: every expert has exactly that many rows from every rank (padded input), so the
    splits are known without an exchange or a host read."""
    p = group.size
    e = counts.numel()
    local = e // p
    if p == 1:
        per_expert = [capacity] * e if capacity is not None else counts.tolist()
        return rows, DispatchState([], [], None, per_expert)
    if capacity is not None:
        in_splits = out_splits = [capacity * local] * p
        recv = None
    else:
        send = counts.view(p, local).contiguous()  # (P, E/P): row j for rank j's experts
        recv = torch.empty_like(send)               # row i: what rank i sends to my experts
        group.all_to_all_single(recv, send)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    received = _AllToAllVForwardAllToAllVBackward.apply(rows, group, out_splits, in_splits)
    local_ids = torch.arange(local, device=rows.device).repeat(p)  # (P E/P,)
    if recv is None:
        ids = local_ids.repeat_interleave(capacity)                   # (N,)
        order = torch.argsort(ids, stable=True)
        return received.index_select(0, order), DispatchState(in_splits, out_splits, order,
                                                              [capacity * p] * local)
    ids = torch.repeat_interleave(local_ids, recv.reshape(-1))      # (N,)
    order = torch.argsort(ids, stable=True)                          # (local expert, source rank)
    return received.index_select(0, order), DispatchState(in_splits, out_splits, order,
                                                          recv.sum(0).tolist())


def alltoall_combine(rows: torch.Tensor, state: DispatchState, group: CommGroup) -> torch.Tensor:
    """The inverse of ``alltoall_dispatch``: (N, h) expert outputs -> (R, h) in the sender's order."""
    if state.order is None:
        return rows
    back = rows.index_select(0, torch.argsort(state.order))  # (source rank, local expert) again
    return _AllToAllVForwardAllToAllVBackward.apply(back, group, state.in_splits, state.out_splits)
