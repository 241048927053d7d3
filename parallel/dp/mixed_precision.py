"""``MixedPrecisionOptimizer``: torch.optim.AdamW (fused on CPU/CUDA, multi-tensor elsewhere) on fp32
master weights of the low-precision parameters, gradients read from the reducer's fp32 buffers;
the frozen-variance update for parameters of sparse-compressed buckets (variance.py). The state
dict has the layout documented in zero.py, with whole per-parameter pieces."""
from __future__ import annotations

import torch

from parallel.dp.onebit import (bind_momentum, momentum_adamw_, momentum_buckets, momentum_now,
                                seed_due)
from parallel.dp.optim_common import (FUSED_ADAMW_DEVICES, _GradAccess, _covering, _entries,
                                      _frozen_adamw_, _sparse_now, copy_)
from parallel.dp.reducer import GradReducer
from parallel.grads.main_grad import current_grad
from parallel.grid.state import ParallelState

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
        self.betas, self.eps = betas, eps
        self._decay = [wd for _, _, wd in entries]
        self.variance_frozen = False
        # host copies of the frozen parameters' Adam step (index -> step): read from the state once,
        # then counted here, so the per-step update reads no device scalar (one sync per tensor)
        self._host_steps: dict[int, int] = {}
        if reducer is not None:
            reducer.beta2 = betas[1]
            bind_momentum(reducer, betas[0])

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
        borrowed, hidden = self._borrow_grads(frozen)
        self.inner.step()
        for m in borrowed:
            m.grad = None
        for m, g in hidden:
            m.grad = g
        self._frozen_step(frozen, lr)
        with torch.no_grad():
            self._copy_masters_to_params()
        self._seed_momentum(seed_due(self.reducer))

    def _seed_momentum(self, buckets) -> None:
        """1-bit buckets (onebit.py): their compressor's momentum from exp_avg, in bucket layout."""
        index = {p: i for i, p in enumerate(self.params)}
        for b in buckets:
            full = torch.zeros(b.numel, dtype=torch.float32, device=b.compressor.residual.device)
            for slot in b.slots:
                st = self.inner.state.get(self.masters[index[slot.param]], {})
                if "exp_avg" in st:
                    full[slot.start - b.start:slot.end - b.start] = st["exp_avg"].reshape(-1)
            b.compressor.set_momentum(full)

    def _borrow_grads(self, frozen: set[int] = frozenset()) -> tuple[list, list]:
        """Point each master's .grad at its parameter's gradient (main_grad: already fp32 and
        shaped like the master, so no op is issued); the parameters in ``frozen`` (a frozen
        variance: not torch's AdamW) have their .grad hidden. Returns (masters that borrowed one,
        (master, hidden grad) pairs)."""
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
            if g is not None and (g.dtype != torch.float32 or g.shape != m.shape):
                g = g.to(torch.float32).view_as(m)
            m.grad = g
            borrowed.append(m)
        return borrowed, hidden

    def _copy_masters_to_params(self) -> None:
        """Updated fp32 masters into the low-precision parameters: one multi-tensor copy."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if pairs:
            copy_([p for p, _ in pairs], [m for _, m in pairs])

    def _frozen_now(self) -> set[int]:
        """Indices of the parameters whose bucket went through a sparse compressor this step (and
        that have Adam state from the warm-up)."""
        if self.reducer is None or not self.reducer.compressed:
            return set()
        return {i for i, (p, m) in enumerate(zip(self.params, self.masters))
                if _sparse_now(self.reducer.bucket_of(p)) and "exp_avg_sq" in self.inner.state.get(m, {})}

    def host_reads(self, device) -> list[torch.Tensor]:
        """The scalars on ``device`` that the coming update reads on the host: AdamW's ``step`` of
        each tensor entering the frozen-variance phase (once per tensor and run; a device tensor
        under fused AdamW). The training step reads them along with its statistics, so they cost
        no wait of their own; ``host_values`` hands their values back. A ``step`` held elsewhere
        (the CPU, under a GPU run) is a host value and is read here (no device wait)."""
        self._wanted = []
        missing = [i for i in sorted(self._frozen_now()) if i not in self._host_steps]
        out = []
        for i in missing:
            step = self.inner.state[self.masters[i]]["step"]
            if isinstance(step, torch.Tensor) and step.device == torch.device(device):
                self._wanted.append(i)
                out.append(step)
            else:  # a host value: torch's own method, not a counted device read
                self._host_steps[i] = int(torch._C.TensorBase.item(step)
                                          if isinstance(step, torch.Tensor) else step)
        return out

    def host_values(self, values) -> None:
        """The values of ``host_reads``' tensors, read by the step's one wait."""
        for i, v in zip(getattr(self, "_wanted", []), values):
            self._host_steps[i] = int(v)
        self._wanted = []

    @torch.no_grad()
    def _frozen_step(self, frozen: set[int], lr: float) -> None:
        """The frozen-variance update of variance.py on the state torch's AdamW keeps."""
        if not frozen:
            return
        for i in frozen:
            if i not in self._host_steps:  # once per tensor and run (a resume reads it again)
                self._host_steps[i] = int(self.inner.state[self.masters[i]]["step"])
        if not self.variance_frozen:                      # the warm-up is over
            for i in frozen:
                st = self.inner.state[self.masters[i]]
                st["exp_avg_sq"].div_(1 - self.betas[1] ** self._host_steps[i])
            self.variance_frozen = True
        refreshed = self.reducer.refreshed
        for i in sorted(frozen):
            p, m = self.params[i], self.masters[i]
            st = self.inner.state[m]
            st["step"] += 1
            self._host_steps[i] += 1
            bucket = self.reducer.bucket_of(p)
            if bucket.index in refreshed:
                slot = next(s for s in bucket.slots if s.param is p)
                lo = slot.start - bucket.start
                st["exp_avg_sq"].copy_(refreshed[bucket.index][lo:lo + slot.numel].view_as(m))
            wd = self._decay[i]
            update = momentum_adamw_ if momentum_now(bucket) else _frozen_adamw_
            update(m.view(-1), current_grad(p).to(torch.float32).reshape(-1),
                   st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1), self._host_steps[i], lr,
                   self.betas, self.eps, [(0, m.numel(), wd)] if wd else [])

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
                "dp_size": self.ps.dp_size, "variance_frozen": self.variance_frozen,
                "pieces": pieces, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        step = int(sd["step"])
        self.variance_frozen = bool(sd.get("variance_frozen", False))
        self._host_steps = {}
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
                                       "exp_avg": tensors["exp_avg"].view_as(m).to(m.device, copy=True),
                                       "exp_avg_sq": tensors["exp_avg_sq"].view_as(m).to(m.device, copy=True)}
        if step > 0 and self.reducer is not None and self.reducer.dp > 1:
            self._seed_momentum(momentum_buckets(self.reducer))   # (the reducer's state wins)
