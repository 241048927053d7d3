"""AdamW with fp32 master weights: sharded over DP (ZeRO-1/2) or not.

``MixedPrecisionOptimizer`` keeps an fp32 master copy of every low-precision parameter and steps
``torch.optim.AdamW`` on the masters (fp32 parameters are their own masters). ``DistributedOptimizer``
(``--use-distributed-optimizer``) cuts the reducer's buckets into dp equal shards (an expert
bucket into |EDP| shards over its expert-data-parallel group, where it is summed): gradients are
reduce-scattered, each rank keeps masters and Adam moments only for its shard of every bucket,
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
sizes. "master" is absent for fp32 parameters (their own shard is the master, master.py) and may
be absent in any checkpoint: the current parameter values are used then.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.dp.master import MIRROR, PARAM, MasterShards
from parallel.dp.offload import HostShards, SplitFlat
from parallel.dp.onebit import (bind_momentum, momentum_adamw_, momentum_buckets, momentum_now,
                                seed_due)
from parallel.dp.optim_common import (_GradAccess, _adamw_, _covering, _entries, _frozen_adamw_,
                                      _sparse_now)
from parallel.dp.param_gather import ParamGather
from parallel.dp.reducer import GradReducer
from parallel.dp.zero3 import ShardedParams
from parallel.grid.state import ParallelState

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
                 zero_stage: int = 1, overlap_param_gather: bool = False,
                 offload_fraction: float | None = None):
        """``zero_stage`` 1 shards the optimizer state, 2 also the fp32 gradient, 3 also the
        parameters (zero3.py: call ``register_param_gather_hooks(model_chunks)``, which gathers
        each unit's buckets ahead of it and frees them after it; the shards live on the
        reducer's device). ``overlap_param_gather``: leave each bucket's parameter
        all-gather in flight until the next forward needs it (ZeRO-3: prefetch the next unit).
        ``offload_fraction``: keep that share of the masters and moments in host memory and
        update them there (offload.py); None keeps everything on the device."""
        entries = _entries(params, weight_decay)
        wd_of = {p: wd for _, p, wd in entries}
        if set(wd_of) != set(reducer.names):
            raise ValueError("DistributedOptimizer: the optimizer's parameters must be exactly the "
                             f"reducer's ({len(wd_of)} given, reducer holds {len(reducer.names)})")
        reducer.shard(zero_stage)
        reducer.beta2 = betas[1]
        bind_momentum(reducer, betas[0])
        self.zero_stage = zero_stage
        self.reducer, self.ps, self.lr, self.betas, self.eps = reducer, ps, lr, betas, eps
        self.dp, self.rank = reducer.dp, reducer.dp_rank      # over DP x CP
        self.pieces: list[ShardPiece] = []
        self._shards = []                     # (bucket, offset in flat shard, length, decay segments)
        offset = 0
        for b in reducer.buckets:      # (an expert bucket's shards are over its EDP group)
            s, e = b.own_range()
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
        device = reducer.buckets[0].own_view().device
        for b in reducer.buckets:           # model-wide grad norm / clipping then read the shards
            for slot in b.slots:
                slot.param.main_grad_shard = torch.empty(0, dtype=reducer.grad_dtype, device=device)
        for piece in self.pieces:
            b = reducer.buckets[piece.bucket]
            lo = piece.buffer_start - b.own_range()[0]
            piece.param.main_grad_shard = b.own_view()[lo:lo + piece.end - piece.start]
        self.param_gather = ShardedParams(reducer, overlap_param_gather, device) \
            if zero_stage == 3 else ParamGather(reducer, overlap_param_gather)
        self.offload = None
        if offload_fraction is not None:
            if any(b.compressor is not None and b.compressor.sparse for b in reducer.buckets):
                raise ValueError("DistributedOptimizer: optimizer offload with a sparse gradient "
                                 "compressor (topk, onebit) is not built")
            self.offload = HostShards(self._shards, offload_fraction, ps, device,
                                      self.param_gather.own_shard)
            reducer.post_reduce_hooks.append(self.offload.grad_ready)
        # fp32 parameters: their own shard is the master (master.py); others get an fp32 copy
        self.master = MasterShards([(b, off, n) for b, off, n, _ in self._shards],
                                   self.param_gather.own_shard, device,
                                   self.offload.master_of if self.offload else None)
        if self.offload is None:
            self.exp_avg = torch.zeros(offset, dtype=torch.float32, device=device)     # (shard,)
            self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        else:   # the offloaded buckets' moments in host memory (they come first in offset order)
            host, entries = self.offload.numel, self.offload.flat_entries
            self.exp_avg = SplitFlat(entries, offset - host, device, self.offload.pin)
            self.exp_avg_sq = SplitFlat(entries, offset - host, device, self.offload.pin)
        self._load_master_from_params()
        self.step_count = 0
        self.variance_frozen = False

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

    def param_pieces(self) -> list[tuple[ShardPiece, torch.Tensor]]:
        """(piece, its values in this rank's shard of the parameters, in their dtype): what a
        ZeRO-3 checkpoint writes and loads for the model (the parameters exist only as shards)."""
        own, out = self.param_gather.own_shard, []
        for p in self.pieces:
            b = self.reducer.buckets[p.bucket]
            lo = p.buffer_start - b.own_range()[0]
            out.append((p, own(b)[lo:lo + p.end - p.start]))
        return out

    def _load_master_from_params(self, only=None) -> None:
        """Masters from this rank's shard of the parameters (an offloaded fp32 master always: it
        mirrors them)."""
        for piece, values in self.param_pieces():
            sl = self._piece_slice(piece)
            kind = self.master.kind(sl)
            if kind == MIRROR or (kind != PARAM and (only is None or piece in only)):
                self.master[sl] = values

    def grad_pieces(self):
        """This rank's averaged gradient shard, as views into the reducer's buffers."""
        return [(p.param.main_grad_shard, p.param) for p in self.pieces]

    def zero_grad(self) -> None:
        if self.offload is not None:   # first: it orders the shards' writes after its copies down
            self.offload.reset()
        self.reducer.zero_grad()

    # ---- offload: the host copies of the gradients follow every change of the device's --------
    def grads_synced(self) -> None:
        """The step's gradient sums after the reduction (SP, tied embeddings) are done."""
        if self.offload is not None:
            self.offload.grads_synced()

    def unscale_(self, factor: float) -> None:
        self._scaling("scale", factor, super().unscale_)

    def clip_(self, coef: float) -> None:
        self._scaling("scale", coef, super().clip_)

    def check_and_unscale_(self, inv_scale: float) -> torch.Tensor:
        return self._scaling("unscale", inv_scale, super().check_and_unscale_)

    def _scaling(self, kind: str, factor: float, apply):
        if self.offload is not None:
            self.offload.before_grad_write()
            self.offload.scale(kind, factor)
        return apply(factor)

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
        host = self.offload.buckets if self.offload is not None else ()
        for b, off, n, segments in self._shards:
            if n == 0 or b.index in host:
                continue
            g = b.own_view().float()
            sl = slice(off, off + n)
            if _sparse_now(b):
                if b.index in refreshed:
                    self.exp_avg_sq[sl] = refreshed[b.index]
                update = momentum_adamw_ if momentum_now(b) else _frozen_adamw_
                update(self.master[sl], g, self.exp_avg[sl], self.exp_avg_sq[sl],
                       self.step_count, lr, self.betas, self.eps, segments)
            else:
                _adamw_(self.master[sl], g, self.exp_avg[sl], self.exp_avg_sq[sl], self.step_count,
                        lr, self.betas, self.eps, segments)
        if self.offload is not None:   # the host's buckets, their parameters copied up
            self.offload.update(self.exp_avg, self.exp_avg_sq, self.step_count, lr, self.betas,
                                self.eps)
        self._seed_momentum(seed_due(self.reducer))
        own = self.param_gather.own_shard
        self.param_gather.launch([(b, own(b) if b.index in host else
                                   self.master[off:off + n].to(b.param_dtype))
                                  for b, off, n, _ in self._shards])

    def skipped_step(self) -> None:
        """No update, and what ``step`` does besides it: every gather waited for and, under ZeRO-3,
        every bucket still gathered (the root unit's, kept from the forward to the step) freed,
        so a skip leaves no parameter storage alive between steps either."""
        self.finish_param_gather()
        super().skipped_step()

    def _seed_momentum(self, buckets) -> None:
        """1-bit buckets (onebit.py): hand this rank's exp_avg shard to the compressor, whose next
        exchange all-gathers the shards into the full momentum."""
        ids = {id(b) for b in buckets}
        for b, off, n, _ in self._shards:
            if id(b) in ids:
                b.compressor.set_momentum_shard(self.exp_avg[off:off + n])

    def state_dict(self, clone: bool = True) -> dict:
        """``clone=False`` returns views of the live state (for a caller that copies them itself)."""
        self.finish_param_gather()
        copy = (lambda t: t.clone()) if clone else (lambda t: t)
        pieces, state = [], {}
        for p in self.pieces:
            sl = self._piece_slice(p)
            pieces.append({"name": p.name, "shape": list(p.param.shape), "start": p.start, "end": p.end,
                           "bucket": p.bucket, "buffer_start": p.buffer_start,
                           "shard_offset": p.shard_offset})
            state[p.name] = {"exp_avg": copy(self.exp_avg[sl]), "exp_avg_sq": copy(self.exp_avg_sq[sl])}
            if not self.master.aliased(sl):   # an fp32 parameter is its own master: not stored twice
                state[p.name]["master"] = copy(self.master[sl])
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
        if self.step_count > 0 and self.dp > 1:     # (the reducer's own state, if saved, wins)
            self._seed_momentum(momentum_buckets(self.reducer))

