"""Where a parameter's gradient lives, and summing a few gradients over a group in one collective.

With the DP reducer a parameter's gradient accumulates in ``param.main_grad`` (a view into an fp32
flat buffer) and ``param.grad`` is freed; without it the gradient is ``param.grad``.
"""
from __future__ import annotations

import torch


def current_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """``param.main_grad`` when the reducer keeps one, else ``param.grad`` (None if neither)."""
    main = getattr(param, "main_grad", None)
    return param.grad if main is None else main


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
    grads = [current_grad(p) for p in params if getattr(p, "sequence_parallel", False)]
    all_reduce_grads_([g for g in grads if g is not None], ps.tp_group)
