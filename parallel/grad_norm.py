"""Global gradient norm, clipping and overflow detection over the whole rank grid.

The norm is that of the serial model's gradient, so each logical value must be counted once:
- a TP-sharded parameter (``param.tp_sharded``) holds a distinct slice on every TP rank: count all;
- a parameter replicated over TP holds the same gradient on every TP rank: count it on tp_rank 0;
- the last stage's copy of a tied embedding (``param.shared_embedding``) duplicates the first
  stage's: skip it;
- the partial sums are added over ``ps.mp_group`` (TP x PP). Gradients are already averaged over
  DP (and CP) and identical there, so DP is not summed, except under ZeRO where each rank of the
  DP x CP group holds only a shard of the gradient (``over_dp=True``: summed over ``dp_cp_group``).

Functions take parameters or explicit ``(grad_tensor, param)`` pairs. A parameter contributes its
``main_grad_shard`` when the ZeRO optimizer set one (then ``over_dp`` defaults to True), else its
``main_grad`` (the reducer's buffer), else its ``grad``; so a trainer can pass the model parameters
whichever optimizer it uses.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.grads import current_grad
from parallel.state import ParallelState


def _items(params) -> list:
    """Parameters, (name, param) pairs -> params; (grad, param) pairs are kept as they are."""
    return [item[1] if isinstance(item, tuple) and isinstance(item[0], str) else item for item in params]


def grad_pieces(params) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
    """(gradient tensor, owning parameter) pairs; parameters without a gradient are left out."""
    pieces = []
    for item in _items(params):
        if isinstance(item, tuple):
            pieces.append(item)
            continue
        if hasattr(item, "main_grad_shard"):          # ZeRO-1: this rank's averaged shard
            if item.main_grad_shard.numel():
                pieces.append((item.main_grad_shard, item))
            continue
        grad = current_grad(item)
        if grad is not None:
            pieces.append((grad, item))
    return pieces


def is_sharded(params) -> bool:
    """Whether these parameters' gradients are ZeRO-1 shards (to be summed over DP)."""
    return any(not isinstance(item, tuple) and hasattr(item, "main_grad_shard") for item in _items(params))


def _counted(param, ps: ParallelState) -> bool:
    if getattr(param, "shared_embedding", False):
        return False
    return bool(getattr(param, "tp_sharded", False)) or ps.tp_rank == 0


def global_grad_norm(params, ps: ParallelState, over_dp: bool | None = None) -> float:
    """L2 norm of the full model's gradient; identical on every rank of the grid."""
    params = list(params)
    over_dp = is_sharded(params) if over_dp is None else over_dp
    pieces = grad_pieces(params)
    device = pieces[0][0].device if pieces else ps.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad, param in pieces:
        if _counted(param, ps):
            total += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
    ps.mp_group.all_reduce(total)
    if over_dp:
        ps.dp_cp_group.all_reduce(total)
    return math.sqrt(total.item())


def clip_grads(params, max_norm: float, ps: ParallelState, over_dp: bool | None = None) -> float:
    """Scale gradients in place so the global norm is at most ``max_norm``; return the norm before.

    Like torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6)), applied only when
    it is below 1 and to every gradient, counted in the norm or not. ``max_norm <= 0`` only measures.
    """
    params = list(params)
    over_dp = is_sharded(params) if over_dp is None else over_dp
    pieces = grad_pieces(params)
    norm = global_grad_norm(pieces, ps, over_dp)
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for grad, _ in pieces:
                grad.mul_(coef)
    return norm


def found_inf(params, ps: ParallelState) -> bool:
    """True on every rank if any gradient on any rank (TP, PP or DP) holds inf or nan.

    All-reduced (MAX) over the world, so every rank takes the same skip decision.
    """
    pieces = grad_pieces(params)
    device = pieces[0][0].device if pieces else ps.device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for grad, _ in pieces:                      # no host sync until the very end
        flag = torch.maximum(flag, (~torch.isfinite(grad)).any().float())
    ps.world_group.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
