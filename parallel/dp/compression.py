"""Gradient compressors for the data-parallel exchange, with error feedback on both sides.

Byte accounting is the communication layer's (parallel/runtime/comm.py): every collective is charged
the payload this rank hands over and the ring-model bytes it sends,

    all_reduce(S bytes)      2 (p-1)/p * S       reduce_scatter(S)  (p-1)/p * S
    all_to_all(S bytes)        (p-1)/p * S       all_gather(s own)  (p-1) * s

so the uncompressed reference for a buffer of n fp32 values is a ring all-reduce, 8 n (p-1)/p.
With this measure an all-gather of a full quantized buffer grows with p (each rank forwards p-1
copies), which is why both compressors use a two-phase exchange whose cost does not depend on p.
The buffer is cut into p shards of m = ceil(n / p) values (shard j is the ZeRO shard of rank j):

    phase 1  all_to_all: each rank sends the compressed shard j of its buffer to rank j
    phase 2  rank j sums the p pieces of shard j, compresses the sum, and all_gather returns
             every compressed shard to every rank, which decompresses them identically.

Under ZeRO (``reduce_scatter_``) only phase 1 runs: rank j keeps the exact sum of the pieces it
received, which is all its optimizer shard needs (the updated parameters come back through ZeRO's
parameter all-gather), so the owner compresses nothing and the bytes halve.

Error feedback on both sides: what a rank does not send (top-k's unselected values, int8's rounding
error, bf16's rounding of the sent values) stays in its ``residual`` and is added to the next
step's buffer; in phase 2 the owner keeps what its re-compression dropped in ``owner_residual``.
Summed over steps, outputs plus all residuals equal the inputs exactly: nothing is lost, only
delayed. Every rank ends with bit-identical results (the last phase is an exact all-gather).

A skipped step (an overflow, a non-finite gradient) must not cost the mass still pending: an
exchange writes its new residuals into new tensors and keeps the ones it started from until the
step's outcome is known (``commit`` drops them, ``reset`` puts them back). That costs no extra
copy, and no memory between steps: both are held only from the exchange to the step's check.

- Int8: symmetric per-chunk quantization, one fp32 scale per ``chunk_size`` values:
  bytes ~ (1 + 4/chunk) / 4 = 0.254 x.
- Top-k: the k = ratio * m largest magnitudes of each shard as (int32 index, bf16 value):
  bytes ~ 1.5 * ratio.

The packed messages are uint8 (the bytes of int8/int32/bf16 values and fp32 scales side by side),
which every backend moves. How the optimizer consumes the result (Adam's second moment frozen for
the sparsifier) is in parallel/dp/variance.py.
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


def _rows(flat: torch.Tensor, p: int, width: int) -> torch.Tensor:
    """(p, width) fp32 with row j = shard j of ``flat`` (m = ceil(n / p) values) zero-padded."""
    n = flat.numel()
    m = math.ceil(n / p)
    x = torch.zeros(p, width, dtype=torch.float32, device=flat.device)
    full = torch.zeros(p * m, dtype=torch.float32, device=flat.device)
    full[:n] = flat
    x[:, :m] = full.view(p, m)
    return x


def _unrows(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of _rows: the first n values of the shards laid end to end."""
    p = x.shape[0]
    m = math.ceil(n / p)
    return x[:, :m].reshape(-1)[:n]


class Compressor:
    """Sum a 1-D buffer over a process group through a compressed exchange, in place.

    ``sparse`` compressors send a small subset of the values each step; the optimizer freezes
    Adam's second moment for their parameters (parallel/dp/variance.py).
    """
    name = "none"
    sparse = False
    owner_phase = False        # True while the owner compresses its summed shard (phase 2)

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None          # (n,) what this rank has not sent yet
        self.owner_residual: torch.Tensor | None = None    # (m,) unsent part of my shard's sum
        self._before: tuple | None = None    # (residual, owner_residual) this step's exchange began with

    # ---- state ---------------------------------------------------------------------------------
    def allocate(self, n: int, p: int, sharded: bool, device) -> None:
        """Create the residuals of a buffer of n values exchanged over p ranks (ZeRO: no owner
        residual, since the owner compresses nothing)."""
        if self.residual is None or self.residual.numel() != n:
            self.residual = torch.zeros(n, dtype=torch.float32, device=device)
        m = math.ceil(n / p)
        if sharded:
            self.owner_residual = None
        elif self.owner_residual is None or self.owner_residual.numel() != m:
            self.owner_residual = torch.zeros(m, dtype=torch.float32, device=device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.residual, self.owner_residual) if t is not None]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.residual is not None:
            out["residual"] = self.residual
        if self.owner_residual is not None:
            out["owner_residual"] = self.owner_residual
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        extra = set(state) - {"residual", "owner_residual"}
        if extra:
            raise ValueError(f"{self.name} compressor: unknown state keys {sorted(extra)}")
        for key in ("residual", "owner_residual"):
            if key in state:
                mine = getattr(self, key)
                if mine is not None and mine.shape != state[key].shape:
                    raise ValueError(f"{self.name} compressor: saved {key} has shape "
                                     f"{list(state[key].shape)}, this layout needs {list(mine.shape)}")
                setattr(self, key, state[key].clone())
        self._before = None

    def _residual_tensors(self) -> list[torch.Tensor]:
        """The error-feedback residuals, in the gradient buffer's (loss-scaled) units."""
        return [t for t in (self.residual, self.owner_residual) if t is not None]

    def rescale_(self, factor: float) -> None:
        """Multiply the residuals by ``factor`` (the loss scale changed; after the step's
        ``commit`` or ``reset``)."""
        for t in self._residual_tensors():
            t.mul_(factor)

    def clear(self) -> None:
        """Zero the residuals (a checkpoint's logical residuals are folded in next)."""
        for t in self._residual_tensors():
            t.zero_()
        self._before = None

    def commit(self) -> None:
        """The step is applied: the residuals it started from are not needed any more."""
        self._before = None

    def reset(self) -> None:
        """The step is skipped (its gradient may be non-finite): the residuals go back to what
        this step's exchange started from, so the mass pending from the steps before is kept."""
        if self._before is not None:
            self.residual, self.owner_residual = self._before
            self._before = None

    def _begin_exchange(self) -> None:
        """Keep the residuals this step starts from (an earlier exchange not committed is
        committed now: nothing can undo it any more)."""
        self._before = (self.residual, self.owner_residual)

    # ---- exchanges -----------------------------------------------------------------------------
    def all_reduce_(self, flat: torch.Tensor, group) -> None:
        """Replace ``flat`` by its (compressed) sum over ``group`` (the data-parallel CommGroup)."""
        p = group.size
        if p == 1:
            return
        n = flat.numel()
        self.allocate(n, p, False, flat.device)
        pieces = self._phase1(flat, group)                      # (p, width): shard j of rank j
        shard = pieces.sum(0)                                    # (width,) my shard, summed
        m = math.ceil(n / p)
        shard[:m] += self.owner_residual
        self.owner_phase = True                                  # (top-k's owner density, dgc.py)
        try:
            packed, sent = self._encode(shard.unsqueeze(0))
            self.owner_residual = (shard - sent[0])[:m].clone()
            gathered = torch.empty(p, packed.shape[1], dtype=torch.uint8, device=flat.device)
            group.all_gather_into(gathered, packed)
            flat.copy_(_unrows(self._decode(gathered, shard.numel()), n))
        finally:
            self.owner_phase = False

    def reduce_scatter_(self, flat: torch.Tensor, group, out: torch.Tensor) -> None:
        """ZeRO: ``out`` (ceil(n / p),) receives this rank's shard of the sum; ``flat`` is not
        used afterwards."""
        p = group.size
        if p == 1:
            out.copy_(flat[:out.numel()])
            return
        self.allocate(flat.numel(), p, True, flat.device)
        out.copy_(self._phase1(flat, group).sum(0)[:out.numel()])

    def _phase1(self, flat: torch.Tensor, group) -> torch.Tensor:
        """Add the residual, compress every shard, keep what was not sent, all_to_all; returns
        the p decompressed pieces of this rank's shard, (p, width) fp32."""
        p, n = group.size, flat.numel()
        width = self._width(math.ceil(n / p))
        x = _rows(flat, p, width) + _rows(self.residual, p, width)
        packed, sent = self._encode(x)
        self._begin_exchange()
        self.residual = _unrows(x - sent, n).clone()       # (the old one is kept: reset)
        self._sent(sent, n)
        recv = torch.empty_like(packed)
        group.all_to_all_single(recv.view(-1), packed.view(-1))
        return self._decode(recv, width)

    def _sent(self, sent: torch.Tensor, n: int) -> None:
        """Phase 1 sent ``sent`` ((p, width) rows, decoded); for subclasses that act on it."""

    def prepare_step(self, compressed_step: int, ramp_steps: int, local_clip: float) -> None:
        """Before each compressed exchange, on every rank alike: the 1-based count of compressed
        steps so far, the policy's sparsity warm-up and the local clipping norm (dgc.py)."""

    # subclasses: rows of ``width`` values -> (packed uint8 rows, the values they decode to)
    def _width(self, m: int) -> int:
        return m

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        raise NotImplementedError


class Int8Compressor(Compressor):
    """Chunk-wise symmetric int8 quantization (round to nearest), one scale per chunk.

    Per value the error of one quantization is at most scale / 2 = max|chunk| / 254; it is kept in
    the residual and sent with the next step's gradient.
    """
    name = "int8"

    def __init__(self, chunk_size: int = 256, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
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

    def _width(self, m: int) -> int:
        return math.ceil(m / self.chunk_size) * self.chunk_size

    def _encode(self, x):
        rows, width = x.shape
        chunks = x.view(rows, width // self.chunk_size, self.chunk_size)
        q, s = self.quantize(chunks)                              # (rows, sc, c), (rows, sc)
        return _as_bytes(q.view(rows, width), s), self.dequantize(q, s).view(rows, width)

    def _decode(self, packed, width):
        sc = width // self.chunk_size
        q, s = _split_bytes(packed, [(torch.int8, width), (self.scale_dtype, sc)])
        return self.dequantize(q.view(-1, sc, self.chunk_size), s).view(-1, width)


class TopKCompressor(Compressor):
    """Magnitude top-k sparsification per shard with error feedback (nothing is ever dropped).

    Each rank adds its residual, keeps the k largest |values| of every destination shard (sent as
    bf16, the rounding stays in the residual) and remembers the rest; each shard owner adds its own
    residual to the summed contributions and again keeps the k largest.
    """
    name = "topk"
    sparse = True

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"TopKCompressor: ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def k(self, m: int) -> int:
        return min(m, max(1, math.ceil(self.ratio * m)))

    def _encode(self, x):
        rows, width = x.shape
        k = self.k(width)
        idx = x.abs().topk(k, dim=1).indices                      # (rows, k)
        vals = x.gather(1, idx).to(torch.bfloat16)                # (rows, k)
        sent = torch.zeros_like(x).scatter_(1, idx, vals.float())
        return _as_bytes(idx.to(torch.int32), vals), sent

    def _decode(self, packed, width):
        k = self.k(width)
        idx, vals = _split_bytes(packed, [(torch.int32, k), (torch.bfloat16, k)])
        out = torch.zeros(packed.shape[0], width, dtype=torch.float32, device=packed.device)
        return out.scatter_(1, idx.long(), vals.float())
