"""Adam's second moment for sparsified buckets: frozen after the warm-up, refreshed from local
statistics (after 1-bit Adam, Tang et al. 2021, and 0/1 Adam's variance freezing, Lu et al. 2022).

Why. Top-k with error feedback delivers each coordinate's gradient in bursts: zero for many steps,
then the accumulated sum. Adam fed with such a stream is starved: the burst G enters the second
moment as G^2, so the update it causes is about G / |G| instead of the sum of the k steps it stands
for. With the second moment v held fixed, the update m / (sqrt(v) + eps) is linear in the gradient
stream, so a burst moves a parameter exactly as far as the k individual steps would have, and the
error feedback's "nothing is lost, only delayed" carries over to the parameters.

How (``policy.warmup_steps`` = W, ``policy.variance_refresh`` = K):

- steps 1..W exchange uncompressed gradients and run plain AdamW;
- with a refresh schedule (K != 0), every step each rank adds the square of its own,
  uncompressed gradient to ``LocalVariance.sq`` (an EMA with Adam's beta2, bias-corrected by its count);
- from step W+1 the optimizer stops updating v for parameters in sparse buckets (v is kept
  bias-corrected from then on) and applies m / (sqrt(v) + eps) with the usual first-moment bias
  correction;
- at step W+1 and then every K steps (W + jK) the ranks average their local statistics over the
  DP group (a two-phase exchange in log-domain uint8: relative error below 2^(span/508) - 1 per
  value, about 0.26x the bytes of an fp32 all-reduce; under ZeRO only phase 1, since only the shard
  owner needs it) and the optimizer replaces v by the result. With K = 0 the warm-up's own v is
  kept for good instead (1-bit Adam's rule).

The local statistics see this rank's share of the batch, whose noise is dp times that of the
global batch, so in the noise-dominated regime the refreshed v is up to dp times the global v
(steps up to sqrt(dp) shorter). That caution is what top-k's delayed bursts want: on the
compression benchmark, a v taken from the exact gradient (smaller) learned slower than this one.
int8 sends every value every step, so its parameters keep plain AdamW (its rounding is error-fed).
"""
from __future__ import annotations

import math

import torch

from parallel.dp.compression import _rows, _unrows


class LogQuantizer:
    """Non-negative values -> uint8 codes in log2 domain per chunk (0 encodes exactly 0), plus the
    chunk's (lo, hi) log2 range as fp32: code q >= 1 decodes to 2^(lo + (q - 1) (hi - lo) / 254)."""

    def __init__(self, chunk_size: int = 256):
        self.chunk_size = chunk_size

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, width) fp32 >= 0, width a multiple of chunk_size -> (rows, bytes) uint8."""
        rows, width = x.shape
        c = x.view(rows, width // self.chunk_size, self.chunk_size)
        pos = c > 0
        logs = torch.where(pos, c.clamp_min(1e-38).log2(), torch.zeros_like(c))
        lo = torch.where(pos, logs, torch.full_like(logs, math.inf)).amin(-1)
        hi = torch.where(pos, logs, torch.full_like(logs, -math.inf)).amax(-1)
        empty = ~pos.any(-1)
        lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
        span = (hi - lo).clamp_min(1e-12).unsqueeze(-1)
        q = torch.round((logs - lo.unsqueeze(-1)) / span * 254).clamp_(0, 254) + 1
        q = torch.where(pos, q, torch.zeros_like(q)).nan_to_num_(0.0).to(torch.uint8)
        ranges = torch.stack([lo, hi], -1).reshape(rows, -1)          # (rows, 2 * chunks) fp32
        return torch.cat([q.view(rows, width), ranges.contiguous().view(torch.uint8)], 1)

    def decode(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        rows, chunks = packed.shape[0], width // self.chunk_size
        q = packed[:, :width].reshape(rows, chunks, self.chunk_size).float()
        ranges = packed[:, width:].contiguous().view(torch.float32).view(rows, chunks, 2)
        lo, hi = ranges[..., :1], ranges[..., 1:]
        vals = torch.exp2(lo + (q - 1).clamp_min(0) * (hi - lo) / 254)
        return torch.where(q > 0, vals, torch.zeros_like(vals)).view(rows, width)


class LocalVariance:
    """This rank's EMA of its squared local gradient for one sparse bucket, and its DP average."""

    def __init__(self, numel: int, device, chunk_size: int = 256):
        self.sq = torch.zeros(numel, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # samples taken in
        self.quantizer = LogQuantizer(chunk_size)

    def update_(self, grad: torch.Tensor, beta2: float, inv_scale: float = 1.0) -> None:
        """``grad``: this rank's own (not yet averaged) gradient of the bucket, still multiplied by
        the loss scale; ``inv_scale`` = 1 / loss scale keeps the statistics in unscaled units. A
        gradient with a non-finite value (this rank's overflow; the step is then skipped on every
        rank) adds nothing, decided on the device: the statistics are never wiped, so a skip keeps
        what the steps before it gathered (the sample of a rank whose gradient is finite stays:
        it is a gradient at the current weights)."""
        new = (self.sq * beta2).addcmul_(grad, grad, value=(1 - beta2) * inv_scale * inv_scale)
        finite = torch.isfinite(new).all()
        torch.where(finite, new, self.sq, out=self.sq)
        self.count.add_(finite)

    def corrected(self, beta2: float) -> torch.Tensor:
        """The EMA bias-corrected by its count (zeros while nothing was taken in: the clamp keeps
        0 / 0 from arising)."""
        bias = 1 - torch.pow(beta2, self.count.to(torch.float32))
        return self.sq / bias.clamp_min(torch.finfo(torch.float32).tiny)

    def average(self, group, beta2: float, sharded: bool) -> torch.Tensor:
        """The bias-corrected statistics averaged over ``group``: the full bucket (every rank the
        same values), or (``sharded``) this rank's 1/p shard."""
        p, n = group.size, self.sq.numel()
        local = self.corrected(beta2)
        if p == 1:
            return local
        m = math.ceil(n / p)
        c = self.quantizer.chunk_size
        width = math.ceil(m / c) * c
        packed = self.quantizer.encode(_rows(local, p, width))
        recv = torch.empty_like(packed)
        group.all_to_all_single(recv.view(-1), packed.view(-1))
        shard = self.quantizer.decode(recv, width).mean(0, keepdim=True)   # (1, width)
        if sharded:
            return shard[0, :m].clone()
        mine = self.quantizer.encode(shard)
        gathered = torch.empty(p, mine.shape[1], dtype=torch.uint8, device=mine.device)
        group.all_gather_into(gathered, mine)
        return _unrows(self.quantizer.decode(gathered, width), n).clone()

    def reset(self) -> None:
        self.sq.zero_()
        self.count.zero_()

    def state_dict(self) -> dict:
        return {"sq": self.sq, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if state["sq"].shape != self.sq.shape:
            raise ValueError(f"local variance: saved shape {list(state['sq'].shape)}, this layout "
                             f"needs {list(self.sq.shape)}")
        self.sq.copy_(state["sq"])
        self.count.copy_(torch.as_tensor(state["count"], dtype=torch.int64))
