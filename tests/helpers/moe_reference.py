"""The plain per-expert math of an MoE layer's experts, from their logical tensors
(``models.logical.logical_views``): the reference the stacked, grouped-GEMM experts are tested
against. ``expert_forward(experts, e, x)``: expert ``e`` (global index) of a ``LocalExperts`` on
rows ``x`` (n, h), by ``F.linear`` per projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.logical import logical_views


def expert_tensors(experts, e: int) -> dict[str, torch.Tensor]:
    """{"fc1.weight": ..., "gate.weight": ..., ...} of expert ``e``."""
    prefix = f"experts.{e}."
    return {n[len(prefix):]: t for n, t in logical_views(experts).items() if n.startswith(prefix)}


def expert_forward(experts, e: int, x: torch.Tensor, with_fc2_bias: bool = True) -> torch.Tensor:
    w = expert_tensors(experts, e)
    if "fc1.weight" in w:
        y = F.gelu(F.linear(x, w["fc1.weight"], w.get("fc1.bias")), approximate="tanh")
    else:
        y = F.silu(F.linear(x, w["gate.weight"], w.get("gate.bias"))) * F.linear(x, w["up.weight"],
                                                                                  w.get("up.bias"))
    return F.linear(y, w["fc2.weight"], w.get("fc2.bias") if with_fc2_bias else None)


def logical_grads(module, zeros: bool = True) -> dict[str, torch.Tensor]:
    """Every logical tensor's gradient by name (``logical_views``'s names): a stacked
    parameter's block of its gradient; a missing gradient as zeros (``zeros``) or None."""
    out = {}
    for name, p in module.named_parameters():
        grad = p.grad if p.grad is not None else (torch.zeros_like(p) if zeros else None)
        parts = getattr(p, "logical_parts", None)
        if not parts:
            out[name] = grad
            continue
        prefix = name.rpartition(".")[0]
        for part in parts:
            out[f"{prefix}.{part.name}" if prefix else part.name] = \
                None if grad is None else part.view(grad)
    return out
