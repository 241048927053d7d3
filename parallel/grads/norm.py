"""Global gradient norm, clipping and overflow detection over the whole rank grid, with multi-tensor
ops and no host sync on the step's path.

The norm is that of the serial model's gradient, so each logical value must be counted once:
- a TP-sharded parameter (``param.tp_sharded``) holds a distinct slice on every TP rank: count all;
- a parameter replicated over TP holds the same gradient on every TP rank: count it on tp_rank 0;
- an expert's parameter (``param.expert_parallel``, models/moe) is distinct on every rank of its
  EP group (``ps.ep_group``) and replicated over EDP and TP: ``global_grad_norm`` sums those over
  the EP group (on tp_rank 0); under ZeRO each EDP rank holds a distinct shard of them, so the
  DP x CP sum (EP x EDP ranks) already counts each once and the EP sum is left out; under
  expert tensor parallelism an expert's slices are ``tp_sharded`` like any TP shard (counted on
  every TP rank, summed over TP by ``grid_norm_sq_``);
- the last stage's copy of a tied embedding (``param.shared_embedding``) duplicates the first
  stage's: skip it;
- the partial sums are added over ``ps.mp_group`` (TP x PP) by ``grid_norm_sq_``; the training
  step instead adds each rank's share (the optimizers' ``grad_norm_sq_share``) in its statistics
  all-reduce over the world (engine/training/step.py). Gradients are already averaged over
  DP (and CP) and identical there, so DP is not summed, except under ZeRO where each rank of the
  DP x CP group holds only a shard of the gradient (``over_dp=True``: summed over ``dp_cp_group``).

Functions take parameters or explicit ``(grad_tensor, param)`` pairs. A parameter contributes its
``main_grad_shard`` when the ZeRO optimizer set one (then ``over_dp`` defaults to True), else its
``main_grad`` (the reducer's buffer), else its ``grad``; so a trainer can pass the model parameters
whichever optimizer it uses.

The step's path (``local_norm_sq``, ``grid_norm_sq_``, ``scale_``, ``check_and_unscale_``) keeps
every result on the device: one ``torch._foreach_*`` op per list of gradient tensors (callers pass
the few flat buffers the gradients live in, see parallel/dp/optim_common.py), and the one host read
of the step happens where the step's statistics are read (engine/training/step.py).
``global_grad_norm``, ``clip_grads`` and ``found_inf`` read the result on the host, for callers
outside the step. The ``*_reference`` functions are the former per-parameter loops (one to four
kernels per tensor): the multi-tensor paths equal them bit for bit on the CPU
(tests/engine/training/test_foreach_grads.py), and benchmarks/host/step_overhead.py times both.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.grads.main_grad import current_grad
from parallel.grid.state import ParallelState

# torch_npu's ForeachNonFiniteCheckAndUnscale kernel takes at most 256 tensors per call (CANN
# ops-nn, foreach_non_finite_check_and_unscale/README.md): its lists are cut at that length
FOREACH_MAX_TENSORS = 256


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


def counted_grads(pieces, ps: ParallelState) -> list[torch.Tensor]:
    """The gradients of ``pieces`` that this rank counts in the global norm (see the module doc)."""
    return [grad for grad, param in pieces if _counted(param, ps)]


def _chunks(tensors: list, by_dtype: bool = True, limit: int | None = None) -> list[list]:
    """The tensors as lists sharing a device and dtype (``by_dtype``), in order, of at most
    ``limit`` tensors each."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype) if by_dtype else None, []).append(t)
    limit = limit or max(1, len(tensors))
    return [group[i:i + limit] for group in groups.values() for i in range(0, len(group), limit)]


# ---- the step's path: device tensors, no host sync ----------------------------------------------

def local_norm_sq(grads: list[torch.Tensor], device=None) -> torch.Tensor:
    """Sum of the squared L2 norms of ``grads``, a 0-d fp32 tensor: ``torch._foreach_norm`` over
    the list (accumulated in fp32), then the norm of the norms."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    mixed = any(g.dtype != torch.float32 for g in grads)
    norms = []
    for chunk in _chunks(grads, by_dtype=False):  # in order: the norm of norms sums them in order
        norms.extend(torch._foreach_norm(chunk, 2, dtype=torch.float32) if mixed
                     else torch._foreach_norm(chunk, 2))
    return torch.linalg.vector_norm(torch.stack(norms)).square()


def grid_norm_sq_(local: torch.Tensor, ps: ParallelState, over_dp: bool) -> torch.Tensor:
    """Sum this rank's counted norm² over the grid in place (TP x PP, and DP x CP for ZeRO
    shards); the squared global norm on every rank, still on the device."""
    ps.mp_group.all_reduce(local)
    if over_dp:
        ps.dp_cp_group.all_reduce(local)
    return local


def scale_(grads: list[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (clipping, unscaling): one op per list.

    fp16/bf16 lists get the factor as an fp32 device tensor: with a Python number the CPU's
    multi-tensor multiply rounds the factor to the list's dtype first, where ``grad.mul_(factor)``
    (and the CUDA kernel) multiply in fp32."""
    for chunk in _chunks(grads):
        if chunk[0].dtype == torch.float32:
            torch._foreach_mul_(chunk, factor)
        else:
            torch._foreach_mul_(chunk, torch.full((), factor, dtype=torch.float32,
                                                  device=chunk[0].device))


def check_and_unscale_(grads: list[torch.Tensor], inv_scale: float, device=None) -> torch.Tensor:
    """This rank's overflow flag (0-d fp32, 1.0 if any gradient holds inf or nan) and, in the same
    pass, the gradients multiplied by ``inv_scale``
    (``torch._amp_foreach_non_finite_check_and_unscale_``, the op torch.amp.GradScaler uses). A
    skipped step discards the gradients, so unscaling them before the skip decision is harmless."""
    found = torch.zeros(1, dtype=torch.float32, device=device if not grads else grads[0].device)
    inv = torch.full((1,), inv_scale, dtype=torch.float32, device=found.device)
    for chunk in _chunks(grads, limit=FOREACH_MAX_TENSORS):
        torch._amp_foreach_non_finite_check_and_unscale_(chunk, found, inv)
    return found.reshape(())


def nonfinite_flag(grads: list[torch.Tensor], device=None) -> torch.Tensor:
    """This rank's overflow flag without unscaling (scale 1)."""
    return check_and_unscale_(grads, 1.0, device)


# ---- host-side helpers (one read each; not for the step's path) ---------------------------------

def global_grad_norm(params, ps: ParallelState, over_dp: bool | None = None) -> float:
    """L2 norm of the full model's gradient; identical on every rank of the grid."""
    params = list(params)
    over_dp = is_sharded(params) if over_dp is None else over_dp
    pieces = grad_pieces(params)
    device = pieces[0][0].device if pieces else ps.device
    experts = [(g, p) for g, p in pieces if getattr(p, "expert_parallel", False)]
    local = local_norm_sq(counted_grads([(g, p) for g, p in pieces
                                         if not getattr(p, "expert_parallel", False)], ps), device)
    if experts:  # each EP rank holds distinct experts (replicated over EDP and TP): add them
        part = local_norm_sq(counted_grads(experts, ps), device)
        if not over_dp:  # (ZeRO shards: the DP x CP sum below covers the EP ranks as well)
            ps.ep_group.all_reduce(part)
        local = local + part
    total = grid_norm_sq_(local, ps, over_dp)
    return math.sqrt(total.item())


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """torch.nn.utils.clip_grad_norm_'s coefficient max_norm / (norm + 1e-6) where it is below 1,
    else None (nothing to do): no clipping for max_norm <= 0 or a non-finite norm."""
    if max_norm <= 0 or not math.isfinite(norm):
        return None
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else None


def clip_grads(params, max_norm: float, ps: ParallelState, over_dp: bool | None = None) -> float:
    """Scale gradients in place so the global norm is at most ``max_norm``; return the norm before.

    Like torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6)), applied only when
    it is below 1 and to every gradient, counted in the norm or not. ``max_norm <= 0`` only
    measures.
    """
    params = list(params)
    over_dp = is_sharded(params) if over_dp is None else over_dp
    pieces = grad_pieces(params)
    norm = global_grad_norm(pieces, ps, over_dp)
    coef = clip_coefficient(norm, max_norm)
    if coef is not None:
        scale_([grad for grad, _ in pieces], coef)
    return norm


def found_inf(params, ps: ParallelState) -> bool:
    """True on every rank if any gradient on any rank (TP, PP or DP) holds inf or nan.

    All-reduced (MAX) over the world, so every rank takes the same skip decision.
    """
    pieces = grad_pieces(params)
    device = pieces[0][0].device if pieces else ps.device
    flag = nonfinite_flag([grad for grad, _ in pieces], device)
    ps.world_group.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


# ---- references: the per-parameter loops the multi-tensor paths replace --------------------------

def local_norm_sq_reference(grads: list[torch.Tensor], device=None) -> torch.Tensor:
    """``local_norm_sq`` one tensor at a time: a norm kernel per gradient."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms)).square()


def scale_reference(grads: list[torch.Tensor], factor: float) -> None:
    for grad in grads:
        grad.mul_(factor)


def check_and_unscale_reference(grads: list[torch.Tensor], inv_scale: float, device=None) -> torch.Tensor:
    """The former overflow check (isfinite, any, max per gradient) and unscale (a mul per gradient)."""
    flag = torch.zeros((), dtype=torch.float32, device=device if not grads else grads[0].device)
    for grad in grads:
        flag = torch.maximum(flag, (~torch.isfinite(grad)).any().float())
    for grad in grads:
        grad.mul_(inv_scale)
    return flag
