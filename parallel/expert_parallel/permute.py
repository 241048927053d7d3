"""Routing metadata on the device: counting the assignments per expert, sorting a layer's token
copies by expert and combining the experts' outputs back, without a host read.

One MoE layer's forward on T tokens of width h, each routed to K of E experts:

    count_per_expert    (T, K) -> (E,) assignments per expert: a ``scatter_add_`` of ones on the
                        device (no ``bincount``, whose output length the host reads), counted once
                        per layer and reused for the load figure, the balancing loss and the
                        experts' row offsets
    permute_tokens      (T, h) -> (T K, h) the K copies of each token sorted by expert (stable:
                        token order inside an expert); with a capacity the dropped copies sort
                        after every expert, so the shape stays T K whatever is dropped
    permute_padded      every expert exactly C rows (padded capacity), the kept copies first
    unpermute_tokens    (rows, (T, K) router weights) -> (T, h): each token's K rows gathered
                        into token order, (T, K, h), times their weights and summed over K in
                        the compute dtype (the reduction accumulates in fp32); a dropped copy
                        weighs 0. One autograd node (forward and backward the ops autograd
                        would run for the expression), which also carries a passenger loss: the
                        layer's balancing losses get their gradient (the step's scale) in its
                        backward, with no node of their own

``Permutation.offsets`` ends each expert's rows (cumulative counts, int32 on the device: the grouped
GEMM's ``offsets``); with a capacity the last expert's group also holds the dropped copies at the
end, which weigh 0 in the combine, so every row belongs to some group and no count is read.
``Permutation.slots`` gives each of the T K assignments its row (the inverse of the sort).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _loss_grad(meta, scale: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient a passenger loss gets from a combine's backward: ``scale`` (a 0-d tensor,
    saved with the node) in the loss's shape and dtype (``meta`` = (shape, dtype) or None
    without a passenger)."""
    if meta is None:
        return None
    shape, dtype = meta
    return scale.to(dtype=dtype, copy=True).reshape(shape)


def passenger_scale(loss: torch.Tensor | None, scale) -> torch.Tensor | None:
    """A passenger loss's gradient ``scale`` as a 0-d fp32 tensor on the loss's device (None
    without a loss). models/moe/layer.py keeps that tensor per layer and refills it each step, so
    a compiled graph takes it as an input instead of guarding on a number that changes with the
    loss scale (a graph per value, eager past the recompile limit)."""
    if loss is None:
        return None
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32, device=loss.device)
    return scale


class _WeightedScatterAddForwardGatherBackward(torch.autograd.Function):
    """out[index[r]] += rows[r] * weight[r] (in the weights' dtype); backward gathers the token
    gradients per row. The allgather dispatcher's combine (allgather.py). ``loss`` (0-d or None)
    rides along: its gradient is ``scale`` (the layer's balancing losses, ``unpermute_tokens``)."""

    @staticmethod
    def forward(ctx, rows, weight, index, num_tokens: int, loss=None, scale=None):
        # rows (R, h), weight (R,), index (R,); scale: 0-d with a loss (``passenger_scale``)
        ctx.save_for_backward(rows, weight, index, scale)
        ctx.loss_meta = None if loss is None else (loss.shape, loss.dtype)
        dtype = torch.promote_types(rows.dtype, weight.dtype)
        out = rows.new_zeros((num_tokens, rows.shape[1]), dtype=dtype)
        return out.index_add_(0, index, rows * weight.unsqueeze(1))  # (T, h)

    @staticmethod
    def backward(ctx, grad):  # (T, h)
        rows, weight, index, scale = ctx.saved_tensors
        g = grad.index_select(0, index)  # (R, h)
        grad_rows = (g * weight.unsqueeze(1)).to(rows.dtype)
        grad_weight = (g * rows).sum(1).to(weight.dtype)
        return grad_rows, grad_weight, None, None, _loss_grad(ctx.loss_meta, scale), None


class _GatherWeightedSumForwardScatterBackward(torch.autograd.Function):
    """out[t] = sum_k rows[slots[t K + k]] * weights[t, k], in the rows' dtype (the sum over K
    accumulates in fp32 inside the reduction); backward: each row's gradient is its token's
    output gradient times its weight (an ``index_select`` by ``order`` where the rows are a
    permutation of the T K assignments, else an ``index_add`` by ``slots``), each weight's the
    product of its row with its token's output gradient summed over h: the ops autograd runs for
    the expression, in one node. ``loss`` (0-d or None) rides along: its gradient is ``scale``."""

    @staticmethod
    def forward(ctx, rows, weights, slots, order, loss=None, scale=None):
        # rows (R', h), weights (T, K), slots (T K,), order (R',) or None; scale: 0-d with a loss
        t, k = weights.shape
        w = weights.to(rows.dtype).unsqueeze(-1)                            # (T, K, 1)
        gathered = rows.index_select(0, slots).view(t, k, rows.shape[1])    # (T, K, h)
        ctx.save_for_backward(gathered, w, slots, order, scale)
        ctx.meta = (rows.shape[0], weights.dtype)
        ctx.loss_meta = None if loss is None else (loss.shape, loss.dtype)
        return (gathered * w).sum(1)                                        # (T, h)

    @staticmethod
    def backward(ctx, grad):  # (T, h)
        gathered, w, slots, order, scale = ctx.saved_tensors
        num_rows, weights_dtype = ctx.meta
        g = grad.unsqueeze(1)                                               # (T, 1, h)
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            per_row = (g * w).view(-1, grad.shape[1])                       # (T K, h)
            grad_rows = per_row.index_select(0, order) if order is not None else \
                per_row.new_zeros((num_rows, grad.shape[1])).index_add_(0, slots, per_row)
        if ctx.needs_input_grad[1]:
            grad_weights = (g * gathered).sum(-1).to(weights_dtype)        # (T, K)
        return grad_rows, grad_weights, None, None, _loss_grad(ctx.loss_meta, scale), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] (R, h); backward sums each row's copies (autograd's own ``index_select``
    backward: zeros, then one ``index_add_``; no Python on the backward's path)."""
    return x.index_select(0, index)


def count_per_expert(experts: torch.Tensor, num_experts: int,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """(T, K) chosen experts -> (E,) int64 assignments per expert, on the device; ``keep``
    (T, K) bool: only the kept ones."""
    flat = experts.reshape(-1)
    ones = torch.ones_like(flat) if keep is None else keep.reshape(-1).to(flat.dtype)
    return torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, ones)


def equal_counts(groups: int, rows: int, device) -> torch.Tensor:
    """(groups,) int64 all ``rows`` (padded capacity), made from an ``arange`` so that the dry
    run's meta tensors carry the values (engine/dryrun/assumed.py)."""
    return torch.arange(groups, device=device) * 0 + rows


def offsets_of(counts: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Cumulative row counts (int32, the grouped GEMM's offsets); ``rows``: the last one set to
    the whole row count (dropped copies at the end join the last group)."""
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    if rows is not None:  # (made from ``ends``: the dry run's assumed counts carry through)
        ends = torch.cat([ends[:-1], ends[-1:] * 0 + rows])
    return ends


@dataclass
class Permutation:
    """Where the T K copies of a layer's tokens went. ``order`` (R,): the flat (T K) assignment of
    each row, rows sorted by expert; ``tokens`` (R,): each row's token; ``counts`` (E,) int64: the
    kept rows per expert; ``offsets`` (E,) int32: the grouped GEMM's row offsets; ``slots``
    (T K,): each assignment's row; ``keep`` (T K,) or None (dropless): 1 where the assignment has
    a row that counts; ``mask`` (R,): 1 for a routed row, 0 for padding (padded only); ``groups``
    (R,): each row's expert (the last one's for a dropped copy at the end; None: padded)."""
    order: torch.Tensor
    tokens: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor
    num_tokens: int
    topk: int
    keep: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    groups: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.order.shape[0]


def permute_tokens(x: torch.Tensor, experts: torch.Tensor, num_experts: int,
                   counts: torch.Tensor | None = None, keep: torch.Tensor | None = None):
    """(T, h) tokens and (T, K) expert indices -> (T K, h) rows sorted by expert, Permutation.
    ``counts``: the layer's ``count_per_expert`` (of the kept assignments with ``keep``), reused;
    ``keep`` (T, K) bool: the dropped copies sort after every expert (rows [sum(counts), T K))."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, torch.full_like(flat, num_experts))
    if counts is None:
        counts = count_per_expert(experts, num_experts, keep)
    groups, order = torch.sort(flat, stable=True)                # (T K,): expert-major
    if keep is not None:  # the dropped copies at the end count in the last expert's group
        groups = groups.clamp(max=num_experts - 1)
    tokens = torch.div(order, k, rounding_mode="floor")
    slots = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=order.device))
    rows = gather_rows(x, tokens)                                 # (T K, h)
    perm = Permutation(order, tokens, counts, offsets_of(counts, None if keep is None else t * k),
                       slots, t, k, None if keep is None else keep.reshape(-1), groups=groups)
    return rows, perm


def permute_padded(x: torch.Tensor, tokens: torch.Tensor, flat_index: torch.Tensor,
                   mask: torch.Tensor, capacity: int, keep: torch.Tensor):
    """Padded to capacity: ``tokens``, ``flat_index`` (into the (T K) assignments) and ``mask``
    (E C,) give each expert's C rows in order; ``keep`` (T, K) the kept assignments -> (E C, h)
    rows and the Permutation."""
    t, k = keep.shape
    e = tokens.numel() // capacity
    device = x.device
    counts = equal_counts(e, capacity, device)
    rows = gather_rows(x, tokens)
    # each kept assignment's slot; padding slots write to a spare entry past the end
    target = torch.where(mask > 0, flat_index, torch.full_like(flat_index, t * k))
    slots = torch.zeros(t * k + 1, dtype=torch.long, device=device).scatter_(
        0, target, torch.arange(e * capacity, device=device))[:t * k]
    perm = Permutation(flat_index, tokens, counts, offsets_of(counts), slots, t, k,
                       keep.reshape(-1), mask)
    return rows, perm


def unpermute_tokens(rows: torch.Tensor, weights: torch.Tensor, perm: Permutation,
                     loss: torch.Tensor | None = None, scale=1.0) -> torch.Tensor:
    """(R', h) expert outputs in the permuted order (R' <= R: the kept rows alone when only they
    were sent), (T, K) router weights -> (T, h) in the rows' dtype. ``loss`` (0-d) rides along
    with gradient ``scale`` (a 0-d tensor or a number: the layer's balancing losses, no autograd
    node of their own)."""
    t, k = perm.num_tokens, perm.topk
    w = weights if perm.keep is None else weights * perm.keep.view(t, k).to(weights.dtype)
    slots = perm.slots if rows.shape[0] >= perm.rows else perm.slots.clamp(max=rows.shape[0] - 1)
    # dropless, every row is one assignment's: the backward gathers instead of adding
    order = perm.order if perm.keep is None and rows.shape[0] == perm.rows == t * k else None
    scale = passenger_scale(loss, scale)
    return _GatherWeightedSumForwardScatterBackward.apply(rows, w, slots, order, loss, scale)
