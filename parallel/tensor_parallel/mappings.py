"""Communication of tensor-parallel regions: one autograd.Function per forward/backward pair.

Activations are batch-first, (b, s, h). "last dim" functions split or gather the hidden/vocab dim
across TP ranks; "sequence" functions do the same along the sequence dim (dim 1) for sequence
parallelism. Every public function takes the group (a ``parallel.runtime.comm.CommGroup``)
explicitly; with a group of size 1 (or None) it returns its input unchanged.
"""
from __future__ import annotations

import torch

from parallel.runtime.comm import group_size


def _check_divisible(x: torch.Tensor, dim: int, size: int) -> None:
    """Fail before the collective, on every rank alike, with what to change."""
    if x.shape[dim] % size == 0:
        return
    if dim == 1:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tp={size}: sequence "
                         f"parallelism keeps s/tp positions per rank; use a sequence length that "
                         f"is a multiple of --tp, or turn off --sequence-parallel")
    raise ValueError(f"dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) does not split "
                     f"over tp={size} ranks")


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group into a fresh tensor. Never in place: autograd may hand the same gradient
    tensor to several consumers (e.g. both inputs of an addition), and the caller's input is theirs."""
    out = x.clone(memory_format=torch.contiguous_format)
    group.all_reduce(out)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    _check_divisible(x, dim, size)
    return x.chunk(size, dim=dim)[group.rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group, async_op: bool = False):
    """All-gather into one (size, *x.shape) tensor, then lay the pieces out along ``dim``.
    With ``async_op``: (a function returning the laid-out tensor once the handle is waited
    for, the handle).

    The single-tensor collectives (rather than lists of tensors) keep torch.compile graphs whole.
    """
    size, dim = group_size(group), dim % x.dim()
    buf = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = group.all_gather_into(buf, x.contiguous(), async_op=async_op)

    def laid_out() -> torch.Tensor:
        if dim == 0:
            return buf
        out_shape = list(x.shape)
        out_shape[dim] *= size
        return buf.view(size, *x.shape).movedim(0, dim).reshape(out_shape)  # (.., size*x.shape[dim], ..)
    return (laid_out, handle) if async_op else laid_out()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk along ``dim`` (single-tensor collective)."""
    size, dim = group_size(group), dim % x.dim()
    _check_divisible(x, dim, size)
    shape = list(x.shape)
    shape[dim : dim + 1] = [size, shape[dim] // size]
    stacked = x.reshape(shape).movedim(dim, 0).contiguous()  # (size, .., x.shape[dim] / size, ..)
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    group.reduce_scatter_into(out, stacked.view(size * out.shape[0], *out.shape[1:]))
    return out


class _IdentityAllReduce(torch.autograd.Function):
    """Copy into the TP region: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllReduceIdentity(torch.autograd.Function):
    """Reduce out of the TP region: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitGather(torch.autograd.Function):
    """Scatter to the TP region along the last dim: forward split, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherSplit(torch.autograd.Function):
    """Gather from the TP region along the last dim: forward all-gather, backward split."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _SeqAllGatherReduceScatter(torch.autograd.Function):
    """Leave the sequence-parallel region: forward all-gather (seq), backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class _SeqReduceScatterAllGather(torch.autograd.Function):
    """Enter the sequence-parallel region from partial sums: forward reduce-scatter, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 1, ctx.group), None


class _SeqSplitGather(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: forward split, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 1, ctx.group), None


def _apply(fn, x, group):
    return x if group_size(group) == 1 else fn.apply(x, group)


def copy_to_tp(x, group):
    return _apply(_IdentityAllReduce, x, group)


def reduce_from_tp(x, group):
    return _apply(_AllReduceIdentity, x, group)


def scatter_to_tp(x, group):
    return _apply(_SplitGather, x, group)


def gather_from_tp(x, group):
    return _apply(_GatherSplit, x, group)


def gather_from_sequence(x, group):
    return _apply(_SeqAllGatherReduceScatter, x, group)


def reduce_scatter_to_sequence(x, group):
    return _apply(_SeqReduceScatterAllGather, x, group)


def scatter_to_sequence(x, group):
    return _apply(_SeqSplitGather, x, group)


def gather_sequence_values(x, group):
    """All-gather along the sequence (dim 1) of a tensor that carries no gradient (indices)."""
    return x if group_size(group) == 1 else _gather(x.contiguous(), 1, group)
