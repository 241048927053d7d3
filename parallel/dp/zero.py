"""AdamW with fp32 master weights: sharded over DP (ZeRO-1/2) or not.

``MixedPrecisionOptimizer`` keeps an fp32 master copy of every low-precision parameter and steps
``torch.optim.AdamW`` on the masters (fp32 parameters are their own masters). ``DistributedOptimizer``
(``--use-distributed-optimizer``) cuts the reducer's buckets into dp equal shards: gradients are
reduce-scattered, each DP rank keeps masters and Adam moments only for its shard of every bucket,
updates them with the same element-wise math as torch.optim.AdamW, and all-gathers the updated
values back into the parameters (cast to their dtype; per bucket, overlapped with the next forward
with ``overlap_param_gather``, see param_gather.py). Optimizer memory per rank drops by dp;
``zero_stage=2`` also keeps only this rank's shard of the fp32 gradient (buffers.py).

Parameters in buckets of a sparse compressor (top-k) take the frozen-variance update once the
policy's warm-up is over (parallel/dp/variance.py): the second moment stops following the gradient
and is replaced only by the reducer's periodic refresh.

Both share one interface for the trainer: ``step(lr)``, ``zero_grad()``, ``grad_pieces()``,
``unscale_(1 / loss_scale)``, ``grad_norm()``, ``clip_grad_norm(max_norm)``, ``found_inf()``,
``state_dict()`` / ``load_state_dict()``. A state dict maps each parameter name to flat pieces::

    {"kind", "step", "dp_rank", "dp_size", "variance_frozen",
     "pieces": [{"name", "shape", "start", "end", ...}],   # flat range [start, end) of the param
     "state": {name: {"exp_avg": (end-start,), "exp_avg_sq": ..., "master": ...}}}

``variance_frozen``: the sparse buckets' exp_avg_sq holds the bias-corrected frozen second moment.

ZeRO pieces also give the bucket, the absolute offset in the gradient buffer and the offset in
this rank's flat shard. ``load_state_dict`` accepts any pieces that cover this rank's ranges (for
example full per-parameter tensors with start 0), so a checkpoint module can re-shard across DP
sizes. "master" may be absent (fp32 checkpoints): the current parameter values are used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.dp.param_gather import ParamGather
from parallel.dp.reducer import GradReducer
from parallel.grad_norm import clip_grads, found_inf, global_grad_norm
from parallel.grads import current_grad
from parallel.state import ParallelState

_KEYS = ("exp_avg", "exp_avg_sq", "master")


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
    """Gradient-side helpers shared by both optimizers (loss scaling, clipping, overflow check)."""
    sharded = False
    ps: ParallelState

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
        raise NotImplementedError

    def unscale_(self, factor: float) -> None:
        """Multiply the gradients the optimizer will use by ``factor`` (1 / loss scale)."""
        for grad, _ in self.grad_pieces():
            grad.mul_(factor)

    def grad_norm(self) -> float:
        return global_grad_norm(self.grad_pieces(), self.ps, over_dp=self.sharded)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grads(self.grad_pieces(), max_norm, self.ps, over_dp=self.sharded)

    def found_inf(self) -> bool:
        return found_inf(self.grad_pieces(), self.ps)


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
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 zero_stage: int = 1, overlap_param_gather: bool = False):
        """``zero_stage`` 1 shards the optimizer state, 2 also the fp32 gradient.
        ``overlap_param_gather``: leave each bucket's parameter all-gather in flight until the
        next forward needs it (call ``register_param_gather_hooks(model_chunks)``)."""
        entries = _entries(params, weight_decay)
        wd_of = {p: wd for _, p, wd in entries}
        if set(wd_of) != set(reducer.names):
            raise ValueError("DistributedOptimizer: the optimizer's parameters must be exactly the "
                             f"reducer's ({len(wd_of)} given, reducer holds {len(reducer.names)})")
        reducer.shard(zero_stage)
        reducer.beta2 = betas[1]
        self.zero_stage = zero_stage
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
        device = reducer.buckets[0].shard_view(self.rank, self.dp).device
        for b in reducer.buckets:           # model-wide grad norm / clipping then read the shards
            for slot in b.slots:
                slot.param.main_grad_shard = torch.empty(0, dtype=reducer.grad_dtype, device=device)
        for piece in self.pieces:
            b = reducer.buckets[piece.bucket]
            lo = piece.buffer_start - b.shard_range(self.rank, self.dp)[0]
            piece.param.main_grad_shard = b.shard_view(self.rank, self.dp)[lo:lo + piece.end - piece.start]
        self.master = torch.zeros(offset, dtype=torch.float32, device=device)     # (shard,)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self._load_master_from_params()
        self.step_count = 0
        self.variance_frozen = False
        self.param_gather = ParamGather(reducer, overlap_param_gather)

    def register_param_gather_hooks(self, modules) -> None:
        """With ``overlap_param_gather``: forward pre-hooks that wait for each module's buckets."""
        self.param_gather.register_hooks(modules)

    def finish_param_gather(self) -> None:
        """Wait for every parameter all-gather still in flight (before reading parameters outside
        a forward: validation, checkpoints, the end of training)."""
        self.param_gather.wait_all()

    def grad_norm(self) -> float:
        self.finish_param_gather()
        return super().grad_norm()

    def clip_grad_norm(self, max_norm: float) -> float:
        self.finish_param_gather()
        return super().clip_grad_norm(max_norm)

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
        self.finish_param_gather()
        sparse = [x for x in self._shards if _sparse_now(x[0])]
        if sparse and not self.variance_frozen:                  # the warm-up is over
            if self.step_count:
                for _, off, n, _ in sparse:
                    self.exp_avg_sq[off:off + n].div_(1 - self.betas[1] ** self.step_count)
            self.variance_frozen = True
        self.step_count += 1
        refreshed = self.reducer.refreshed
        for b, off, n, segments in self._shards:
            if n == 0:
                continue
            g = b.shard_view(self.rank, self.dp).float()
            sl = slice(off, off + n)
            if _sparse_now(b):
                if b.index in refreshed:
                    self.exp_avg_sq[sl] = refreshed[b.index]
                _frozen_adamw_(self.master[sl], g, self.exp_avg[sl], self.exp_avg_sq[sl],
                               self.step_count, lr, self.betas, self.eps, segments)
            else:
                _adamw_(self.master[sl], g, self.exp_avg[sl], self.exp_avg_sq[sl], self.step_count,
                        lr, self.betas, self.eps, segments)
        self.param_gather.launch([(b, self.master[off:off + n].to(b.param_dtype))
                                  for b, off, n, _ in self._shards])

    def state_dict(self) -> dict:
        self.finish_param_gather()
        pieces, state = [], {}
        for p in self.pieces:
            sl = self._piece_slice(p)
            pieces.append({"name": p.name, "shape": list(p.param.shape), "start": p.start, "end": p.end,
                           "bucket": p.bucket, "buffer_start": p.buffer_start,
                           "shard_offset": p.shard_offset})
            state[p.name] = {"exp_avg": self.exp_avg[sl].clone(), "exp_avg_sq": self.exp_avg_sq[sl].clone(),
                             "master": self.master[sl].clone()}
        return {"kind": "distributed", "step": self.step_count, "dp_rank": self.rank, "dp_size": self.dp,
                "variance_frozen": self.variance_frozen, "pieces": pieces, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        self.finish_param_gather()
        self.step_count = int(sd["step"])
        self.variance_frozen = bool(sd.get("variance_frozen", False))
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
        # foreach: one multi-tensor update instead of a Python loop over parameters (torch only
        # defaults to it on accelerators)
        self.inner = torch.optim.AdamW([{"params": ms, "weight_decay": wd} for wd, ms in groups.items()],
                                       lr=lr, betas=betas, eps=eps, foreach=True)
        self.betas, self.eps = betas, eps
        self._decay = [wd for _, _, wd in entries]
        self.variance_frozen = False
        if reducer is not None:
            reducer.beta2 = betas[1]

    def grad_pieces(self):
        return [(g, p) for p in self.params if (g := current_grad(p)) is not None]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.reducer is not None:
            self.reducer.zero_grad()        # (points fp32 params' grad at their main_grad again)

    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        if self.reducer is not None:
            self.reducer.check_finished("MixedPrecisionOptimizer.step")
        for group in self.inner.param_groups:
            group["lr"] = lr
        frozen = self._frozen_now()
        borrowed, hidden = [], []
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            g = current_grad(p)
            if i in frozen:                               # frozen variance: not torch's AdamW
                if m.grad is not None:
                    hidden.append((m, m.grad))
                    m.grad = None
                continue
            if m is p and g is p.grad:
                continue                                  # fp32: its grad is its main_grad
            m.grad = None if g is None else g.to(torch.float32).view_as(m)
            borrowed.append(m)
        self.inner.step()
        for m in borrowed:
            m.grad = None
        for m, g in hidden:
            m.grad = g
        self._frozen_step(frozen, lr)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def _frozen_now(self) -> set[int]:
        """Indices of the parameters whose bucket went through a sparse compressor this step (and
        that have Adam state from the warm-up)."""
        if self.reducer is None or not self.reducer.compressed:
            return set()
        return {i for i, (p, m) in enumerate(zip(self.params, self.masters))
                if _sparse_now(self.reducer.bucket_of(p)) and "exp_avg_sq" in self.inner.state.get(m, {})}

    @torch.no_grad()
    def _frozen_step(self, frozen: set[int], lr: float) -> None:
        """The frozen-variance update of variance.py on the state torch's AdamW keeps."""
        if not frozen:
            return
        if not self.variance_frozen:                      # the warm-up is over
            for i in frozen:
                st = self.inner.state[self.masters[i]]
                st["exp_avg_sq"].div_(1 - self.betas[1] ** int(st["step"]))
            self.variance_frozen = True
        refreshed = self.reducer.refreshed
        for i in sorted(frozen):
            p, m = self.params[i], self.masters[i]
            st = self.inner.state[m]
            st["step"] += 1
            bucket = self.reducer.bucket_of(p)
            if bucket.index in refreshed:
                slot = next(s for s in bucket.slots if s.param is p)
                lo = slot.start - bucket.start
                st["exp_avg_sq"].copy_(refreshed[bucket.index][lo:lo + slot.numel].view_as(m))
            wd = self._decay[i]
            _frozen_adamw_(m.view(-1), current_grad(p).to(torch.float32).reshape(-1),
                           st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1), int(st["step"]), lr,
                           self.betas, self.eps, [(0, m.numel(), wd)] if wd else [])

    @property
    def step_count(self) -> int:
        for m in self.masters:
            if "step" in self.inner.state.get(m, {}):
                return int(self.inner.state[m]["step"])
        return 0

    def state_dict(self) -> dict:
        pieces, state = [], {}
        for name, p, m in zip(self.names, self.params, self.masters):
            pieces.append({"name": name, "shape": list(p.shape), "start": 0, "end": p.numel()})
            st = self.inner.state.get(m, {})
            entry = {k: st[k].detach().reshape(-1).clone() for k in ("exp_avg", "exp_avg_sq") if k in st}
            if m is not p:
                entry["master"] = m.detach().reshape(-1).clone()
            state[name] = entry
        return {"kind": "mixed_precision", "step": self.step_count, "dp_rank": self.ps.dp_rank,
                "dp_size": self.ps.dp_size, "variance_frozen": self.variance_frozen,
                "pieces": pieces, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        step = int(sd["step"])
        self.variance_frozen = bool(sd.get("variance_frozen", False))
        cover = {e["name"]: (e["start"], e["end"]) for e in sd.get("pieces", [])}
        for name, p, m in zip(self.names, self.params, self.masters):
            tensors = _covering(sd, cover, name, 0, p.numel(), p.numel())
            with torch.no_grad():
                if m is not p:
                    m.copy_(tensors["master"].view_as(m) if "master" in tensors else p.detach().float())
                    p.copy_(m)
            if step > 0:
                self.inner.state[m] = {"step": torch.tensor(float(step)),
                                       "exp_avg": tensors["exp_avg"].view_as(m).clone(),
                                       "exp_avg_sq": tensors["exp_avg_sq"].view_as(m).clone()}
