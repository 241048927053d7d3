"""What both AdamW optimizers share (zero.py, mixed_precision.py): the gradient-side helpers on
the few flat tensors the gradients live in (loss scaling, clipping, overflow check, norm), the
element-wise AdamW updates, and the checks of a state dict's pieces. The state-dict layout is
documented in zero.py."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.dp.onebit import seed_due
from parallel.dp.reducer import GradReducer
from parallel.grads.norm import (check_and_unscale_, clip_coefficient, counted_grads,
                                 grid_norm_sq_, local_norm_sq, nonfinite_flag, scale_)
from parallel.grads.main_grad import coalesce_views
from parallel.grid.state import ParallelState

_KEYS = ("exp_avg", "exp_avg_sq", "master")
FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # torch.optim.AdamW(fused=True) kernels in PyTorch itself


def _entries(params, weight_decay: float) -> list[tuple[str, torch.nn.Parameter, float]]:
    """(name, param, weight decay) from a Module, params, (name, param) pairs or torch-style groups;
    unnamed parameters are called param0, param1, ... in order over all groups."""
    if isinstance(params, torch.nn.Module):
        params = list(params.named_parameters())
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        wd = float(group.get("weight_decay", weight_decay))
        for item in group["params"]:
            name, p = item if isinstance(item, tuple) else (f"param{len(out)}", item)
            if p.requires_grad:
                out.append((name, p, wd))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("optimizer: parameter names must be unique; pass (name, param) pairs")
    return out


class _GradAccess:
    """Gradient-side helpers shared by both optimizers (loss scaling, clipping, overflow check,
    and what a skipped step leaves to do: ``skipped_step``).

    They work on the few flat tensors the gradients live in (``grad_tensors``: the reducer's
    buffers or ZeRO's shards, coalesced from the per-parameter views), one multi-tensor op each,
    and keep results on the device; ``grad_norm``, ``clip_grad_norm`` and ``found_inf`` read them
    on the host for callers outside the step.
    """
    sharded = False
    ps: ParallelState
    reducer: GradReducer | None = None

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
        raise NotImplementedError

    def _seed_momentum(self, buckets) -> None:
        raise NotImplementedError

    def skipped_step(self) -> None:
        """A step skipped (an overflow, a non-finite gradient) leaves the weights and exp_avg as
        they were; a 1-bit bucket whose compression starts at the next step takes its momentum
        from that exp_avg now, as ``step`` does after an update (else it would start from zero)."""
        self._seed_momentum(seed_due(self.reducer))

    def _views(self, counted: bool, part: str = "all") -> list[torch.Tensor]:
        """Gradients as flat runs (all of them, or those counted in the norm). With a reducer the
        views are fixed for the optimizer's life and built once; plain ``param.grad`` tensors are
        new every step."""
        cache = self.__dict__.setdefault("_view_cache", {})
        if (counted, part) in cache:
            return cache[(counted, part)]
        pieces = self.grad_pieces()
        if part != "all":  # "expert": models/moe's expert weights, "dense": everything else
            pieces = [(g, p) for g, p in pieces
                      if bool(getattr(p, "expert_parallel", False)) == (part == "expert")]
        views = coalesce_views(counted_grads(pieces, self.ps) if counted else [g for g, _ in pieces])
        if self.reducer is not None:
            cache[(counted, part)] = views
        return views

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient element the optimizer uses, in as few tensors as possible."""
        return self._views(counted=False)

    def _device(self) -> torch.device:
        views = self.grad_tensors()
        return views[0].device if views else self.ps.device

    def unscale_(self, factor: float) -> None:
        """Multiply the gradients the optimizer will use by ``factor`` (1 / loss scale)."""
        scale_(self.grad_tensors(), factor)

    def clip_(self, coef: float) -> None:
        """Multiply the gradients by a clipping coefficient (``clip_coefficient``)."""
        scale_(self.grad_tensors(), coef)

    @property
    def _expert_parallel(self) -> bool:
        """Expert weights differ between the ranks of an EP group (grid/expert_groups.py)."""
        return self.ps.edp_group is not self.ps.dp_cp_group and self.ps.ep_group.size > 1

    def grad_norm_sq(self) -> torch.Tensor:
        """The squared global norm, a 0-d fp32 tensor on the device, equal on every rank. Under
        ZeRO an expert's gradient is cut over its EDP group and the EP ranks hold distinct
        experts, so every shard over DP x CP (= EP x EDP) is distinct: the DP x CP sum counts all."""
        if not self._expert_parallel or self.sharded:
            local = local_norm_sq(self._views(counted=True), self._device())
            return grid_norm_sq_(local, self.ps, over_dp=self.sharded)
        experts = local_norm_sq(self._views(True, "expert"), self._device())
        self.ps.ep_group.all_reduce(experts)  # distinct experts on each EP rank
        local = local_norm_sq(self._views(True, "dense"), self._device()) + experts
        return grid_norm_sq_(local, self.ps, over_dp=self.sharded)

    def grad_norm_sq_share(self) -> torch.Tensor:
        """This rank's share of the squared global norm (0-d fp32, no collective): summed over
        the world it is ``grad_norm_sq()``. Under ZeRO every rank's shard counts (an expert
        bucket's shards, over its EDP group, too); otherwise the gradients are the same on every
        rank of the DP x CP group and its first rank counts."""
        if self.sharded or (self.ps.dp_cp_group.rank == 0 and not self._expert_parallel):
            return local_norm_sq(self._views(counted=True), self._device())
        share = torch.zeros((), dtype=torch.float32, device=self._device())
        if self._expert_parallel:  # expert weights: the first rank of each EDP group counts them
            if self.ps.dp_cp_group.rank == 0:
                share = share + local_norm_sq(self._views(True, "dense"), self._device())
            if self.ps.edp_group.rank == 0:
                share = share + local_norm_sq(self._views(True, "expert"), self._device())
        return share

    def check_and_unscale_(self, inv_scale: float) -> torch.Tensor:
        """This rank's overflow flag (0-d fp32) and the gradients unscaled, in one pass."""
        return check_and_unscale_(self.grad_tensors(), inv_scale, self._device())

    def grad_norm(self) -> float:
        return math.sqrt(self.grad_norm_sq().item())

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = self.grad_norm()
        coef = clip_coefficient(norm, max_norm)
        if coef is not None:
            self.clip_(coef)
        return norm

    def found_inf(self) -> bool:
        flag = nonfinite_flag(self.grad_tensors(), self._device())
        self.ps.world_group.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


def copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) (casting to dst's dtype) for every i: one multi-tensor copy."""
    if dst:
        torch._foreach_copy_(dst, src)


def _adamw_(p, g, m, v, step, lr, betas, eps, decay_segments) -> None:
    """torch.optim.AdamW's single-tensor update, element-wise on flat fp32 views."""
    beta1, beta2 = betas
    for lo, hi, wd in decay_segments:
        p[lo:hi].mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def _frozen_adamw_(p, g, m, v, step, lr, betas, eps, decay_segments) -> None:
    """The frozen-variance update (variance.py): AdamW with ``v`` the bias-corrected second moment,
    left unchanged, so the step is linear in the gradient."""
    for lo, hi, wd in decay_segments:
        p[lo:hi].mul_(1 - lr * wd)
    m.lerp_(g, 1 - betas[0])
    p.addcdiv_(m, v.sqrt().add_(eps), value=-lr / (1 - betas[0] ** step))


def _sparse_now(bucket) -> bool:
    """Whether this step's exchange of ``bucket`` went through a sparse compressor."""
    return bucket is not None and bucket.compressed_step and bucket.compressor.sparse


def _covering(sd: dict, cover: dict, name: str, start: int, end: int, numel: int) -> dict:
    """Slices [start, end) of the saved flat tensors of ``name``, checking that they cover it."""
    if name not in sd["state"]:
        if int(sd["step"]) == 0:
            return {}
        raise KeyError(f"optimizer state has no entry for parameter {name!r}")
    src_start, src_end = cover.get(name, (0, numel))
    if not (src_start <= start and end <= src_end):
        raise ValueError(f"optimizer state for {name!r} covers [{src_start}, {src_end}) but this rank "
                         f"needs [{start}, {end}); assemble the full tensor before loading")
    return {k: t.reshape(-1)[start - src_start:end - src_start] for k, t in sd["state"][name].items()
            if k in _KEYS}

