"""Which gradient buffer each parameter goes to (the reducer's layout, reducer.py).

Parameters are laid out in reverse registration order (backward produces the last ones first) and
grouped into one buffer per (parameter dtype, compressor) pair, with two kinds of parameters kept
apart: a weight tied across pipeline stages gets a buffer of its own, so that its ZeRO shard covers
the same elements on both stages and the tied gradients can be summed after the reduction; and
expert weights (``param.expert_parallel``, models/moe) go to buffers of their own, since they are
summed (and, under ZeRO, sharded) over the expert-data-parallel group instead of DP x CP.
"""
from __future__ import annotations

import torch

from parallel.dp.buffers import GradBuffer


def named_parameters(params) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, param) pairs that require grad, from a Module, (name, param) pairs or bare params."""
    if isinstance(params, torch.nn.Module):
        params = params.named_parameters()
    named, seen = [], set()
    for i, item in enumerate(params):
        name, param = item if isinstance(item, tuple) else (f"param{i}", item)
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return named


def build_buffers(named, policy, grad_dtype: torch.dtype, bucket_numel: int, pad: int,
                  unit_of: dict | None = None, device=None,
                  deferred: bool = False) -> tuple[list[GradBuffer], list[GradBuffer]]:
    """(every buffer, the expert buffers among them) for ``named`` in registration order;
    ``unit_of``, ``device`` and ``deferred``: GradBuffer's (ZeRO-3's unit boundaries, where the
    gradients live, no flat buffer)."""
    groups: dict[tuple, list] = {}
    for name, p in reversed(named):
        alone = id(p) if getattr(p, "tied_across_stages", False) else None
        expert = bool(getattr(p, "expert_parallel", False))
        groups.setdefault((p.dtype, policy.compressor_for(name), alone, expert), []).append((name, p))
    buffers = [GradBuffer(members, spec, grad_dtype, bucket_numel, pad, unit_of, device, deferred)
               for (_, spec, _, _), members in groups.items()]
    return buffers, [buf for (*_, expert), buf in zip(groups, buffers) if expert]
