"""Gradient compressors for the data-parallel exchange.

Byte accounting is the communication layer's (parallel/comm.py): every collective is charged the
payload this rank hands over and the ring-model bytes it sends,

    all_reduce(S bytes)      2 (p-1)/p * S       reduce_scatter(S)  (p-1)/p * S
    all_to_all(S bytes)        (p-1)/p * S       all_gather(s own)  (p-1) * s

so the uncompressed reference for a buffer of n fp32 values is a ring all-reduce, 8 n (p-1)/p.
With this measure an all-gather of a full quantized buffer grows with p (each rank forwards p-1
copies), which is why both compressors use a two-phase exchange whose cost does not depend on p:

    phase 1  all_to_all: each rank sends shard j of its compressed buffer to rank j
    phase 2  rank j sums the p pieces of shard j, compresses the sum, and all_gather returns
             every compressed shard to every rank, which decompresses them identically.

Int8: one fp32 scale per chunk of ``chunk_size`` values, so bytes ~ (1 + 4/chunk) / 4 = 0.254 x.
Top-k: k = ratio * shard values per shard as (int32 index, fp32 value), bytes ~ 2 * ratio.
Every rank ends with bit-identical results (the last phase is an exact all-gather), so data-parallel
replicas cannot drift apart. Top-k keeps what it did not send in residuals (error feedback): one
per rank for its local buffer, one per shard owner for the re-sparsified sum. The packed messages
are uint8 (bytes of int8/int32 values and fp32 scales side by side), which every backend moves.
"""
from __future__ import annotations

import math

import torch


def _as_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the raw bytes of 2-D tensors row by row: (p, a) int8 + (p, b) fp32 -> (p, a+4b)."""
    return torch.cat([t.contiguous().view(torch.uint8).reshape(t.shape[0], -1) for t in tensors], 1)


def _split_bytes(packed: torch.Tensor, specs: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Inverse of _as_bytes: (p, B) uint8 -> one (p, count) tensor per (dtype, count) spec."""
    out, col = [], 0
    for dtype, count in specs:
        width = count * torch.empty((), dtype=dtype).element_size()
        out.append(packed[:, col:col + width].contiguous().view(dtype))
        col += width
    return out


class Compressor:
    """Sum a 1-D buffer over a process group through a compressed exchange, in place."""
    name = "none"

    def all_reduce_(self, flat: torch.Tensor, group) -> None:
        """``group``: the data-parallel CommGroup."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{self.name} compressor keeps no state, got keys {sorted(state)}")

    def rescale_(self, factor: float) -> None:
        """Multiply any kept residual by ``factor`` (the loss scale changed)."""

    def reset(self) -> None:
        """Drop any kept residual (after a skipped step it may hold non-finite values)."""


class Int8Compressor(Compressor):
    """Chunk-wise symmetric int8 quantization (round to nearest), one scale per chunk.

    Per value the error of one quantization is at most scale / 2 = max|chunk| / 254; the result
    carries p such errors from phase 1 and one from phase 2.
    """
    name = "int8"

    def __init__(self, chunk_size: int = 256, scale_dtype: torch.dtype = torch.float32):
        if chunk_size < 1:
            raise ValueError(f"Int8Compressor: chunk_size must be >= 1, got {chunk_size}")
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"Int8Compressor: scale_dtype must be float32 or float16, got {scale_dtype}")
        self.chunk_size = chunk_size
        self.scale_dtype = scale_dtype

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., c) fp32 -> (..., c) int8 values and (...) scales; a non-finite chunk stays non-finite."""
        scale = (x.abs().amax(-1) / 127.0).to(self.scale_dtype).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe.unsqueeze(-1)).clamp_(-127, 127)
        return q.nan_to_num_(0.0).to(torch.int8), scale.to(self.scale_dtype)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return q.float() * scale.float().unsqueeze(-1)

    def all_reduce_(self, flat: torch.Tensor, group) -> None:
        p = group.size
        if p == 1:
            return
        n, c = flat.numel(), self.chunk_size
        sc = math.ceil(math.ceil(n / c) / p)                     # chunks per shard
        x = torch.zeros(p * sc * c, dtype=torch.float32, device=flat.device)
        x[:n] = flat
        q, s = self.quantize(x.view(p, sc, c))                   # (p, sc, c), (p, sc)
        send = _as_bytes(q.view(p, sc * c), s)                   # (p, B): row j goes to rank j
        recv = torch.empty_like(send)
        group.all_to_all_single(recv.view(-1), send.view(-1))
        rq, rs = _split_bytes(recv, [(torch.int8, sc * c), (self.scale_dtype, sc)])
        shard = self.dequantize(rq.view(p, sc, c), rs).sum(0)    # (sc, c): my shard, summed
        q2, s2 = self.quantize(shard)
        mine = _as_bytes(q2.view(1, sc * c), s2.view(1, sc))     # (1, B)
        gathered = torch.empty(p, mine.shape[1], dtype=torch.uint8, device=flat.device)
        group.all_gather_into(gathered, mine)
        gq, gs = _split_bytes(gathered, [(torch.int8, sc * c), (self.scale_dtype, sc)])
        flat.copy_(self.dequantize(gq.view(p, sc, c), gs).view(-1)[:n])


class TopKCompressor(Compressor):
    """Magnitude top-k sparsification per shard with error feedback (nothing is ever dropped).

    Each rank adds its residual, keeps the k largest |values| of every destination shard and
    remembers the rest; each shard owner adds its own residual to the summed contributions and
    again keeps the k largest. Sum over steps of outputs + all residuals == sum of inputs.
    """
    name = "topk"

    def __init__(self, ratio: float = 0.01):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"TopKCompressor: ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.residual: torch.Tensor | None = None          # (n,) this rank's unsent values
        self.owner_residual: torch.Tensor | None = None    # (m,) unsent part of my shard's sum

    def all_reduce_(self, flat: torch.Tensor, group) -> None:
        p = group.size
        if p == 1:
            return
        n = flat.numel()
        m = math.ceil(n / p)
        k = min(m, max(1, math.ceil(self.ratio * m)))
        if self.residual is None or self.residual.numel() != n:
            self.residual = torch.zeros(n, dtype=torch.float32, device=flat.device)
            self.owner_residual = torch.zeros(m, dtype=torch.float32, device=flat.device)
        acc = torch.zeros(p * m, dtype=torch.float32, device=flat.device)
        acc[:n] = flat
        acc[:n] += self.residual
        blocks = acc.view(p, m)
        idx = blocks.abs().topk(k, dim=1).indices               # (p, k)
        vals = blocks.gather(1, idx)                             # (p, k)
        blocks.scatter_(1, idx, 0.0)                             # what stays behind
        self.residual.copy_(acc[:n])
        send = _as_bytes(idx.to(torch.int32), vals)              # (p, 8k)
        recv = torch.empty_like(send)
        group.all_to_all_single(recv.view(-1), send.view(-1))
        ridx, rvals = _split_bytes(recv, [(torch.int32, k), (torch.float32, k)])
        shard = self.owner_residual.clone()
        shard.index_add_(0, ridx.reshape(-1).long(), rvals.reshape(-1))   # (m,)
        sidx = shard.abs().topk(k).indices                       # (k,)
        svals = shard[sidx]
        shard[sidx] = 0.0
        self.owner_residual.copy_(shard)
        mine = _as_bytes(sidx.to(torch.int32).view(1, k), svals.view(1, k))
        gathered = torch.empty(p, mine.shape[1], dtype=torch.uint8, device=flat.device)
        group.all_gather_into(gathered, mine)
        gidx, gvals = _split_bytes(gathered, [(torch.int32, k), (torch.float32, k)])
        offsets = torch.arange(p, device=flat.device).unsqueeze(1) * m
        out = torch.zeros(p * m, dtype=torch.float32, device=flat.device)
        out[(gidx.long() + offsets).view(-1)] = gvals.view(-1)
        flat.copy_(out[:n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.residual is None:
            return {}
        return {"residual": self.residual, "owner_residual": self.owner_residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residual = state["residual"].clone() if "residual" in state else None
        self.owner_residual = state["owner_residual"].clone() if "owner_residual" in state else None

    def rescale_(self, factor: float) -> None:
        if self.residual is not None:
            self.residual.mul_(factor)
            self.owner_residual.mul_(factor)

    def reset(self) -> None:
        if self.residual is not None:
            self.residual.zero_()
            self.owner_residual.zero_()
