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
    collective for all, one concatenation in and one multi-tensor copy out."""
    if not grads or group.size == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.all_reduce(flat)
    pieces = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [p.view_as(g) for p, g in zip(pieces, grads)])


def sync_sequence_parallel_grads(params, ps) -> None:
    """Norm weights (and row-parallel biases) under sequence parallelism saw only a sequence
    shard: sum their gradients over TP, once per step."""
    if ps.tp_group.size == 1:
        return
    grads = [reduced_grad(p) for p in params if getattr(p, "sequence_parallel", False)]
    all_reduce_grads_([g for g in grads if g is not None and g.numel()], ps.tp_group)


def coalesce_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same elements as ``tensors`` in as few 1-D tensors as possible: contiguous tensors that
    sit back to back in one storage (the main_grad views of a reducer buffer, ZeRO's shard pieces)
    become one view of that storage. Each element appears once; storages come in the order
    they first appear in ``tensors`` (not by address, so the result is the same in every run),
    offsets in storage order.

    Three views [0:3], [3:5] and [6:9] of one buffer give two tensors, [0:5] and [6:9]; tensors of
    separate storages (plain ``param.grad``) are returned as 1-D views, one each, and
    non-contiguous ones as they are.
    """
    runs: list[list] = []   # [first tensor, storage offset, numel]
    first_seen: dict[int, int] = {}   # storage -> its first position in ``tensors``: a fixed order
    keyed = []
    for i, t in enumerate(tensors):
        if t.numel() and t.is_contiguous():
            ptr = t.untyped_storage()._cdata  # the storage itself: data_ptr is 0 on the meta device
            keyed.append((first_seen.setdefault(ptr, i), t.storage_offset(), i, ptr, t))
    keyed = [(ptr, offset, i, t) for _, offset, i, ptr, t in sorted(keyed, key=lambda k: k[:3])]
    last_ptr = None
    for ptr, offset, _, t in keyed:
        if runs and ptr == last_ptr and runs[-1][0].dtype == t.dtype and offset == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += t.numel()
        elif runs and ptr == last_ptr and offset < runs[-1][1] + runs[-1][2]:
            raise ValueError("coalesce_views: overlapping gradient views")
        else:
            runs.append([t, offset, t.numel()])
        last_ptr = ptr
    out = [t.as_strided((n,), (1,), offset) for t, offset, n in runs]
    out += [t for t in tensors if t.numel() and not t.is_contiguous()]   # as they are (in place)
    return out
