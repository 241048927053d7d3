"""AdamW with fp32 master weights: sharded over DP (ZeRO-1) or not.

``MixedPrecisionOptimizer`` keeps an fp32 master copy of every low-precision parameter and steps
``torch.optim.AdamW`` on the masters (fp32 parameters are their own masters). ``DistributedOptimizer``
(``--use-distributed-optimizer``) cuts the reducer's buckets into dp equal shards: gradients are
reduce-scattered, each DP rank keeps masters and Adam moments only for its shard of every bucket,
updates them with the same element-wise math as torch.optim.AdamW, and all-gathers the updated
values back into the parameters (cast to their dtype). Optimizer memory per rank drops by dp.

Both share one interface for the trainer: ``step(lr)``, ``zero_grad()``, ``grad_pieces()``,
``unscale_(1 / loss_scale)``, ``grad_norm()``, ``clip_grad_norm(max_norm)``, ``found_inf()``,
``state_dict()`` / ``load_state_dict()``. A state dict maps each parameter name to flat pieces::

    {"kind", "step", "dp_rank", "dp_size",
     "pieces": [{"name", "shape", "start", "end", ...}],   # flat range [start, end) of the param
     "state": {name: {"exp_avg": (end-start,), "exp_avg_sq": ..., "master": ...}}}

ZeRO pieces also give the bucket, the absolute offset in the gradient buffer and the offset in
this rank's flat shard. ``load_state_dict`` accepts any pieces that cover this rank's ranges (for
example full per-parameter tensors with start 0), so a checkpoint module can re-shard across DP
sizes. "master" may be absent (fp32 checkpoints): the current parameter values are used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.dp.reducer import GradReducer
from parallel.grad_norm import (check_and_unscale_, clip_coefficient,
                                counted_grads, grid_norm_sq_, local_norm_sq, nonfinite_flag, scale_)
from parallel.grads import coalesce_views, current_grad
from parallel.state import ParallelState

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
    """Gradient-side helpers shared by both optimizers (loss scaling, clipping, overflow check).

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

    def _views(self, counted: bool) -> list[torch.Tensor]:
        """Gradients as flat runs (all of them, or those counted in the norm). With a reducer the
        views are fixed for the optimizer's life and built once; plain ``param.grad`` tensors are
        new every step."""
        cache = self.__dict__.setdefault("_view_cache", {})
        if counted in cache:
            return cache[counted]
        pieces = self.grad_pieces()
        views = coalesce_views(counted_grads(pieces, self.ps) if counted else [g for g, _ in pieces])
        if self.reducer is not None:
            cache[counted] = views
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

    def grad_norm_sq(self) -> torch.Tensor:
        """The squared global norm, a 0-d fp32 tensor on the device, equal on every rank."""
        local = local_norm_sq(self._views(counted=True), self._device())
        return grid_norm_sq_(local, self.ps, over_dp=self.sharded)

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


@dataclass(eq=False)
class ShardPiece:
    """The part of one parameter inside this rank's shard of one bucket."""
    name: str
    param: torch.nn.Parameter
    bucket: int
    start: int            # flat range [start, end) within the parameter
    end: int
    buffer_start: int     # absolute offset in the gradient buffer
    shard_offset: int     # offset in this rank's flat master/moment tensors
    weight_decay: float


class DistributedOptimizer(_GradAccess):
    sharded = True

    def __init__(self, params, reducer: GradReducer, ps: ParallelState, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        entries = _entries(params, weight_decay)
        wd_of = {p: wd for _, p, wd in entries}
        if set(wd_of) != set(reducer.names):
            raise ValueError("DistributedOptimizer: the optimizer's parameters must be exactly the "
                             f"reducer's ({len(wd_of)} given, reducer holds {len(reducer.names)})")
        reducer.shard_grads = True
        self.reducer, self.ps, self.lr, self.betas, self.eps = reducer, ps, lr, betas, eps
        self.dp, self.rank = reducer.dp, reducer.dp_rank      # over DP x CP
        self.pieces: list[ShardPiece] = []
        self._shards = []                     # (bucket, offset in flat shard, length, decay segments)
        offset = 0
        for b in reducer.buckets:
            s, e = b.shard_range(self.rank, self.dp)
            segments = []
            for slot in b.slots:
                lo, hi = max(s, slot.start), min(e, slot.end)
                if lo >= hi:
                    continue
                wd = wd_of[slot.param]
                self.pieces.append(ShardPiece(slot.name, slot.param, b.index, lo - slot.start,
                                              hi - slot.start, lo, offset + lo - s, wd))
                if wd != 0.0:
                    if segments and segments[-1][1] == lo - s and segments[-1][2] == wd:
                        segments[-1] = (segments[-1][0], hi - s, wd)
                    else:
                        segments.append((lo - s, hi - s, wd))
            self._shards.append((b, offset, e - s, segments))
            offset += e - s
        device = reducer.buckets[0].data.device
        for b in reducer.buckets:           # model-wide grad norm / clipping then read the shards
            for slot in b.slots:
                slot.param.main_grad_shard = b.data.new_empty(0)
        for piece in self.pieces:
            piece.param.main_grad_shard = reducer.buckets[piece.bucket].buffer.data[
                piece.buffer_start:piece.buffer_start + piece.end - piece.start]
        self.master = torch.zeros(offset, dtype=torch.float32, device=device)     # (shard,)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self._load_master_from_params()
        self.step_count = 0

    def _piece_slice(self, piece: ShardPiece) -> slice:
        return slice(piece.shard_offset, piece.shard_offset + piece.end - piece.start)

    def _load_master_from_params(self, only=None) -> None:
        for piece in self.pieces:
            if only is None or piece in only:
                self.master[self._piece_slice(piece)] = piece.param.detach().reshape(-1)[piece.start:piece.end]

    def grad_pieces(self):
        """This rank's averaged gradient shard, as views into the reducer's buffers."""
        return [(p.param.main_grad_shard, p.param) for p in self.pieces]

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def step(self, lr: float | None = None) -> None:
        """One AdamW step on this rank's shard, then all-gather the parameters."""
        lr = self.lr if lr is None else lr
        self.reducer.check_finished("DistributedOptimizer.step")
        self.step_count += 1
        for b, off, n, segments in self._shards:
            if n == 0:
                continue
            g = b.shard_view(self.rank, self.dp).float()
            sl = slice(off, off + n)
            _adamw_(self.master[sl], g, self.exp_avg[sl], self.exp_avg_sq[sl], self.step_count,
                    lr, self.betas, self.eps, segments)
        self._gather_params()

    def _gather_params(self) -> None:
        gathered = []
        for b, off, n, _ in self._shards:
            shard = self.master[off:off + n].to(b.param_dtype)
            if self.dp == 1:
                gathered.append((b, shard, None))
                continue
            full = torch.empty(b.numel, dtype=b.param_dtype, device=shard.device)
            handle = self.reducer.group.all_gather_into(full, shard, async_op=True)
            gathered.append((b, full, handle))
        for b, full, handle in gathered:
            if handle is not None:
                handle.wait()
            with torch.no_grad():
                self._copy_to_params(b, full)

    def _copy_to_params(self, b, full: torch.Tensor) -> None:
        """The updated bucket ``full`` (b.numel,) into its parameters: one split, one copy."""
        targets = self.__dict__.setdefault("_param_views", {})
        if b.index not in targets:   # flat views of the bucket's parameters, in slot order
            targets[b.index] = ([slot.param.view(-1) for slot in b.slots],
                                [slot.numel for slot in b.slots] + [b.end - b.slots[-1].end])
        params, sizes = targets[b.index]
        copy_(params, list(full.split(sizes))[:len(params)])

    def state_dict(self, clone: bool = True) -> dict:
        """``clone=False`` returns views of the live state (for a caller that copies them itself)."""
        copy = (lambda t: t.clone()) if clone else (lambda t: t)
        pieces, state = [], {}
        for p in self.pieces:
            sl = self._piece_slice(p)
            pieces.append({"name": p.name, "shape": list(p.param.shape), "start": p.start, "end": p.end,
                           "bucket": p.bucket, "buffer_start": p.buffer_start,
                           "shard_offset": p.shard_offset})
            state[p.name] = {"exp_avg": copy(self.exp_avg[sl]), "exp_avg_sq": copy(self.exp_avg_sq[sl]),
                             "master": copy(self.master[sl])}
        return {"kind": "distributed", "step": self.step_count, "dp_rank": self.rank, "dp_size": self.dp,
                "pieces": pieces, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        cover = {e["name"]: (e["start"], e["end"]) for e in sd.get("pieces", [])}
        no_master = []
        for p in self.pieces:
            tensors = _covering(sd, cover, p.name, p.start, p.end, p.param.numel())
            sl = self._piece_slice(p)
            for key, dst in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq), ("master", self.master)):
                if key in tensors:
                    dst[sl] = tensors[key]
                elif key == "master":
                    no_master.append(p)
                elif self.step_count > 0:
                    raise KeyError(f"optimizer state for {p.name!r} lacks {key!r}")
        self._load_master_from_params(only=no_master)


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


class MixedPrecisionOptimizer(_GradAccess):
    """torch.optim.AdamW on fp32 masters; gradients come from ``main_grad`` (the reducer) or ``grad``."""

    def __init__(self, params, reducer: GradReducer | None = None, ps: ParallelState | None = None,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        entries = _entries(params, weight_decay)
        names = reducer.names if reducer is not None else {}
        self.reducer, self.lr = reducer, lr
        self.ps = ps or (reducer.ps if reducer is not None else ParallelState.serial())
        self.names = [names.get(p, n) for n, p, _ in entries]
        self.params = [p for _, p, _ in entries]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        groups: dict[float, list] = {}
        for (_, _, wd), master in zip(entries, self.masters):
            groups.setdefault(wd, []).append(master)
        # one update op per parameter group instead of a Python loop over parameters: the fused
        # kernel where PyTorch has one (CPU, CUDA: no per-parameter host reads of the step count),
        # else the multi-tensor (foreach) update
        self._fused = bool(self.masters) and self.masters[0].device.type in FUSED_ADAMW_DEVICES
        kind = {"fused": True} if self._fused else {"foreach": True}
        self.inner = torch.optim.AdamW([{"params": ms, "weight_decay": wd} for wd, ms in groups.items()],
                                       lr=lr, betas=betas, eps=eps, **kind)


    def grad_pieces(self):
        return [(g, p) for p in self.params if (g := current_grad(p)) is not None]

    def zero_grad(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()
        for p in self.params:
            p.grad = None

    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        if self.reducer is not None:
            self.reducer.check_finished("MixedPrecisionOptimizer.step")
        for group in self.inner.param_groups:
            group["lr"] = lr
        borrowed = self._borrow_grads()
        self.inner.step()
        for m in borrowed:
            m.grad = None
        with torch.no_grad():
            self._copy_masters_to_params()

    def _borrow_grads(self) -> list[torch.Tensor]:
        """Point each master's .grad at its parameter's gradient (main_grad: already fp32 and
        shaped like the master, so no op is issued); returns the masters that borrowed one."""
        borrowed = []
        for p, m in zip(self.params, self.masters):
            g = current_grad(p)
            if m is p and g is p.grad:
                continue                                  # plain fp32 parameter with its own grad
            if g is not None and (g.dtype != torch.float32 or g.shape != m.shape):
                g = g.to(torch.float32).view_as(m)
            m.grad = g
            borrowed.append(m)
        return borrowed

    def _copy_masters_to_params(self) -> None:
        """Updated fp32 masters into the low-precision parameters: one multi-tensor copy."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if pairs:
            copy_([p for p, _ in pairs], [m for _, m in pairs])

    @property
    def step_count(self) -> int:
        for m in self.masters:
            if "step" in self.inner.state.get(m, {}):
                return int(self.inner.state[m]["step"])
        return 0

    def state_dict(self, clone: bool = True) -> dict:
        """``clone=False`` returns views of the live state (for a caller that copies them itself)."""
        copy = (lambda t: t.detach().reshape(-1).clone()) if clone else (lambda t: t.detach().reshape(-1))
        pieces, state = [], {}
        for name, p, m in zip(self.names, self.params, self.masters):
            pieces.append({"name": name, "shape": list(p.shape), "start": 0, "end": p.numel()})
            st = self.inner.state.get(m, {})
            entry = {k: copy(st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st}
            if m is not p:
                entry["master"] = copy(m)
            state[name] = entry
        return {"kind": "mixed_precision", "step": self.step_count, "dp_rank": self.ps.dp_rank,
                "dp_size": self.ps.dp_size, "pieces": pieces, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        step = int(sd["step"])
        cover = {e["name"]: (e["start"], e["end"]) for e in sd.get("pieces", [])}
        for name, p, m in zip(self.names, self.params, self.masters):
            tensors = _covering(sd, cover, name, 0, p.numel(), p.numel())
            with torch.no_grad():
                if m is not p:
                    m.copy_(tensors["master"].view_as(m) if "master" in tensors else p.detach().float())
                    p.copy_(m)
            if step > 0:
                self.inner.state[m] = {"step": torch.tensor(float(step),
                                                            device=m.device if self._fused else "cpu"),
                                       "exp_avg": tensors["exp_avg"].view_as(m).clone(),
                                       "exp_avg_sq": tensors["exp_avg_sq"].view_as(m).clone()}
