"""Where a parameter's gradient lives, and summing a few gradients over a group in one collective.

With the DP reducer a parameter's gradient accumulates in ``param.main_grad`` (a view into an fp32
flat buffer) and ``param.grad`` is freed; without it the gradient is ``param.grad``. Under ZeRO the
reduced gradient is this rank's shard, ``param.main_grad_shard`` (ZeRO-2 frees the rest): the
element-wise fix-ups after the reduction work on it, so every TP rank, whose bucket layout is the
same, sums the same elements.
"""
from __future__ import annotations

import torch


def current_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """``param.main_grad`` when the reducer keeps one, else ``param.grad`` (None if neither)."""
    main = getattr(param, "main_grad", None)
    return param.grad if main is None else main


def reduced_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """What holds ``param``'s DP-reduced gradient after ``reducer.finish()``: its ZeRO shard
    (``main_grad_shard``, possibly empty; under ZeRO-2 the only copy) or its full gradient."""
    shard = getattr(param, "main_grad_shard", None)
    return current_grad(param) if shard is None else shard


def all_reduce_grads_(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` (a CommGroup) in place, flattened into one buffer: one
    collective for all."""
    if not grads or group.size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_sequence_parallel_grads(params, ps) -> None:
    """Norm weights (and row-parallel biases) under sequence parallelism saw only a sequence
    shard: sum their gradients over TP, once per step."""
    if ps.tp_group.size == 1:
        return
    grads = [reduced_grad(p) for p in params if getattr(p, "sequence_parallel", False)]
    all_reduce_grads_([g for g in grads if g is not None and g.numel()], ps.tp_group)
