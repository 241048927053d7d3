"""Which gradient buffer each parameter goes to (the reducer's layout, reducer.py).

Parameters are laid out in reverse registration order (backward produces the last ones first) and
grouped into one buffer per (parameter dtype, compressor) pair, with two kinds of parameters kept
apart: a weight tied across pipeline stages gets a buffer of its own, so that its ZeRO shard covers
the same elements on both stages and the tied gradients can be summed after the reduction; and
expert weights (``param.expert_parallel``, models/moe) go to buffers of their own, since they are
summed (and, under ZeRO, sharded) over the expert-data-parallel group instead of DP x CP.
Under gradient compression three classes of weights also go apart (``tp_class``): those whose
gradient is the same on every TP rank (replicated and unmarked: a position table, norms without
SP), TP shards, and partial gradients summed over TP after the reduction (``sequence_parallel``).
A compressor's choices depend on the whole bucket (top-k's threshold and local clipping, int8's
and 1-bit's chunk scales), and a mixed bucket would compress the same gradient differently on each
TP rank, so the replicated weight's copies would drift apart (engine/training/model_checks.py
finds that); a partial bucket's refreshed variance is summed over TP (reducer.py).
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


def tp_class(p, spec) -> str | None:
    """Under compression, how ``p``'s gradient stands over the TP ranks: "shard" (``tp_sharded``),
    "partial" (``sequence_parallel``: summed over TP after the reduction) or "same"; None
    uncompressed (one class)."""
    if not spec.compressed:
        return None
    if getattr(p, "tp_sharded", False):
        return "shard"
    return "partial" if getattr(p, "sequence_parallel", False) else "same"


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
        spec = policy.compressor_for(name)
        groups.setdefault((p.dtype, spec, alone, expert, tp_class(p, spec)),
                          []).append((name, p))
    buffers = [GradBuffer(members, spec, grad_dtype, bucket_numel, pad, unit_of, device, deferred)
               for (_, spec, *_), members in groups.items()]
    return buffers, [buf for (_, _, _, expert, _), buf in zip(groups, buffers) if expert]
