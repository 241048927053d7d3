"""1-bit Adam's compressed momentum exchange (Tang et al. 2021, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed").

Why the momentum and not the gradient. After the warm-up Adam's second moment v is frozen
(variance.py, warmup.py), so Adam becomes momentum SGD with a fixed preconditioner: the update is
m / (sqrt(v) + eps), linear in m. Signs of a raw gradient are mostly noise; the momentum averages
that noise over about 1 / (1 - beta1) steps, so its sign with one scale per chunk carries most of
what the update needs, and error feedback delivers the rest a few steps later.

One exchange, on every rank r of p (every value in the scaled units of the gradient buffer):

    m_r   = beta1 * M + (1 - beta1) * g_r          this rank's momentum; M is the synchronized
                                                   momentum of the last step, equal on all ranks
    phase 1  the buffer m_r / p + residual_r is cut into p shards; shard j is compressed to signs
             plus one fp32 scale, the mean |value|, per ``chunk_size`` values, and sent to rank j
             (all-to-all); what the signs do not carry stays in residual_r (worker side)
    phase 2  rank j sums its p pieces, adds owner_residual_j, compresses the sum again, keeps the
             difference (server side), and an all-gather returns every compressed shard to every
             rank, so every rank decodes the same new M

Under ZeRO both phases run too (unlike int8 and top-k, whose ZeRO form stops after phase 1):
every rank needs the whole new M to form its next m_r, and the 1-bit all-gather costs little.
Bytes per value and phase: 1/8 + 4/chunk_size, about 0.035x of an fp32 all-reduce in total.

The optimizer (zero.py, mixed_precision.py) takes the exchanged M as Adam's first moment and
steps p -= lr * M / (1 - beta1^t) / (sqrt(v) + eps) with decoupled weight decay. M itself is kept
here, unscaled (in the optimizer's units), for the next exchange; a skipped step (overflow) puts
back the M of the step before. The optimizer seeds M from its exp_avg when compression starts
and after a checkpoint is loaded onto another layout (under ZeRO each rank holds only its shard of
exp_avg: the shards are all-gathered by the first exchange, on the exchange worker's
communicator); on the same layout the saved M is restored exactly.
"""
from __future__ import annotations

import math

import torch

from parallel.dp.compression import Compressor, _as_bytes, _split_bytes
from parallel.dp.momentum_state import MomentumState


def _shifts(device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """(rows, width) bool, width a multiple of 8 -> (rows, width / 8) uint8, bit i of byte b is
    value 8 b + i."""
    rows, width = positive.shape
    bits = positive.view(rows, width // 8, 8).to(torch.uint8)
    return (bits << _shifts(bits.device)).sum(-1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of pack_signs: (rows, width / 8) uint8 -> (rows, width) bool."""
    rows = packed.shape[0]
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.view(rows, width).bool()


class OneBitCompressor(MomentumState, Compressor):
    """Sign plus a per-chunk scale, with error feedback on both sides, of the local momentum."""
    name = "onebit"
    sparse = True                  # the frozen-variance update applies (variance.py)

    def __init__(self, chunk_size: int = 256, beta1: float = 0.9):
        super().__init__()
        if chunk_size < 8 or chunk_size % 8:
            raise ValueError(f"OneBitCompressor: chunk_size must be a positive multiple of 8, "
                             f"got {chunk_size}")
        self.chunk_size = chunk_size
        self._init_momentum(beta1)

    def allocate(self, n: int, p: int, sharded: bool, device) -> None:
        super().allocate(n, p, False, device)         # phase 2 runs under ZeRO too

    def all_reduce_(self, flat: torch.Tensor, group) -> None:
        """``flat``: this rank's gradient divided by p (scaled); afterwards the new M (scaled),
        identical on every rank."""
        p, n = group.size, flat.numel()
        if p == 1:
            return
        self.allocate(n, p, False, flat.device)
        scale = float(self.loss_scale())
        old = self._momentum_now(n, group)
        flat.mul_(1.0 - self.beta1).add_(old, alpha=self.beta1 * scale / p)
        self.sign_all_reduce_(flat, group)
        new = self._spare(old)
        torch.div(flat, scale, out=new)
        self._advance(old, new)

    def sign_all_reduce_(self, flat: torch.Tensor, group) -> None:
        """The compressed two-phase sum of ``flat`` over ``group``, error-fed on both sides."""
        Compressor.all_reduce_(self, flat, group)

    def reduce_scatter_(self, flat: torch.Tensor, group, out: torch.Tensor) -> None:
        """ZeRO: the whole exchange (M is needed in full), then this rank's shard into ``out``."""
        self.all_reduce_(flat, group)
        m = out.numel()
        out.copy_(flat[group.rank * m:(group.rank + 1) * m])

    def _width(self, m: int) -> int:
        return math.ceil(m / self.chunk_size) * self.chunk_size

    def encode_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, width) -> (sign bits, (rows, chunks) scales); a non-finite chunk decodes
        non-finite, so an overflow still reaches the check after the exchange."""
        rows, width = x.shape
        chunks = x.view(rows, width // self.chunk_size, self.chunk_size)
        return pack_signs(x >= 0), chunks.abs().mean(-1)

    def decode_rows(self, bits: torch.Tensor, scale: torch.Tensor, width: int) -> torch.Tensor:
        rows, c = bits.shape[0], self.chunk_size
        pos = unpack_signs(bits, width).view(rows, width // c, c)
        s = scale.unsqueeze(-1)
        return torch.where(pos, s, -s).view(rows, width)

    def _encode(self, x):
        bits, scale = self.encode_rows(x)
        return _as_bytes(bits, scale), self.decode_rows(bits, scale, x.shape[1])

    def _decode(self, packed, width):
        bits, scale = _split_bytes(packed, [(torch.uint8, width // 8),
                                            (torch.float32, width // self.chunk_size)])
        return self.decode_rows(bits, scale, width)


# ---- the optimizers' side ------------------------------------------------------------------------
def momentum_now(bucket) -> bool:
    """Whether this step's exchange of ``bucket`` delivered the momentum (1-bit Adam)."""
    return (bucket is not None and bucket.compressed_step
            and getattr(bucket.compressor, "exchanges_momentum", False))


def momentum_buckets(reducer) -> list:
    if reducer is None:
        return []
    return [b for b in reducer.buckets if getattr(b.compressor, "exchanges_momentum", False)]


def bind_momentum(reducer, beta1: float) -> None:
    """Give the 1-bit compressors the optimizer's beta1 and the trainer's loss scale (read when
    each exchange runs: the scaler is attached to the reducer after it is built)."""
    def scale() -> float:
        s = getattr(reducer, "loss_scaler", None)
        return 1.0 if s is None else float(s.scale)
    for b in momentum_buckets(reducer):
        b.compressor.beta1, b.compressor.loss_scale = beta1, scale


def seed_due(reducer) -> list:
    """The 1-bit buckets whose M must come from exp_avg now: the step just taken was not
    compressed and the next one is (the warm-up ends)."""
    if reducer is None or reducer.dp == 1 or not reducer.compressing():
        return []
    return [b for b in momentum_buckets(reducer) if not b.compressed_step]


@torch.no_grad()
def momentum_adamw_(p, m_new, m, v, step, lr, betas, eps, decay_segments) -> None:
    """1-bit Adam's update: ``m_new`` is the exchanged momentum; it becomes exp_avg, and
    p -= lr * m / (1 - beta1^step) / (sqrt(v) + eps) with v frozen (bias-corrected)."""
    for lo, hi, wd in decay_segments:
        p[lo:hi].mul_(1 - lr * wd)
    m.copy_(m_new)
    p.addcdiv_(m, v.sqrt().add_(eps), value=-lr / (1 - betas[0] ** step))
