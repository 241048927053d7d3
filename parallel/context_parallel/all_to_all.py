"""Ulysses' communication (``--cp-comm-type a2a``): all-to-all between sequence-sharded and
head-sharded attention tensors, one autograd.Function per forward/backward pair.

Tensors are (b, heads, s, d) as the attention kernels take them. Before attention each of the cp
ranks holds all of its TP rank's heads for a contiguous 1/cp of the sequence; ``seq_to_head`` gives
it 1/cp of those heads for the whole sequence (the shards land in rank order, which is sequence
order); ``head_to_seq`` is the inverse, after attention. Each is one ``all_to_all_single`` on the
CP group: piece j of the send buffer (head group j, resp. sequence shard j) goes to rank j.
"""
from __future__ import annotations

import torch

from parallel.runtime.comm import group_size


def _check_heads(x: torch.Tensor, size: int) -> None:
    if x.shape[1] % size:
        raise ValueError(f"Ulysses attention splits the {x.shape[1]} heads of a TP rank over cp={size} "
                         f"ranks: --num-attention-heads / --tp must be divisible by --cp (or use "
                         f"--cp-comm-type p2p)")


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(b, n, s, d) sequence shard -> (b, n/cp, cp*s, d) head shard."""
    p = group.size
    b, n, s, d = x.shape
    send = x.reshape(b, p, n // p, s, d).transpose(0, 1).contiguous()  # (cp, b, n/cp, s, d)
    recv = torch.empty_like(send)
    group.all_to_all_single(recv, send)  # piece i: rank i's sequence shard of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // p, p * s, d)


def _head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, n/cp, cp*s, d) head shard -> (b, n, s, d) sequence shard."""
    p = group.size
    b, nh, sp, d = x.shape
    send = x.reshape(b, nh, p, sp // p, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, b, n/cp, s, d)
    recv = torch.empty_like(send)
    group.all_to_all_single(recv, send)  # piece i: head group i of my sequence shard
    # laid out (b, s, n, d) in memory, as SDPA's output: the model's head merge is then a view
    return recv.permute(1, 3, 0, 2, 4).reshape(b, sp // p, p * nh, d).transpose(1, 2)


class _AllToAllSeqToHead(torch.autograd.Function):
    """Forward: sequence shard -> head shard; backward: head shard -> sequence shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _AllToAllHeadToSeq(torch.autograd.Function):
    """Forward: head shard -> sequence shard; backward: sequence shard -> head shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(b, n, s/cp, d) on each CP rank -> (b, n/cp, s, d); identity on a group of one."""
    if group_size(group) == 1:
        return x
    _check_heads(x, group.size)
    return _AllToAllSeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, n/cp, s, d) on each CP rank -> (b, n, s/cp, d); identity on a group of one."""
    if group_size(group) == 1:
        return x
    if x.shape[2] % group.size:
        raise ValueError(f"sequence length {x.shape[2]} does not split over cp={group.size} ranks")
    return _AllToAllHeadToSeq.apply(x, group)
