"""The tiles of FP8 blockwise scaling (kernels/fp8_blockwise.py): 1 x 128 tiles along a GEMM's
contraction, 128 x 128 weight blocks and 128 x 1 token tiles cut per sequence; their scales, the
quantization with them, the reference product they define, the rule a layout must keep so that
every tile is whole on one rank, and the graded operands and per-block error the probe and the
device check judge the kernels with.

A scale is ``kernels.fp8.amax_to_scale`` of a tile's amax in e4m3, rounded down to a power of two;
a dimension that is not a multiple of 128 ends in a partial tile (zero-padded for the amax, which
a zero does not change).
"""
from __future__ import annotations

import torch

from kernels.fp8 import E4M3, amax_to_scale, quantize

BLOCK = 128


def tile_bounds(length: int, per: int | None = None) -> list[tuple[int, int]]:
    """The K tiles of a contraction of ``length``: 128 at a time, or, with ``per`` (the sequence
    length of a (b * s)-token contraction), 128 at a time within each sequence of ``per``.

    >>> tile_bounds(300)
    [(0, 128), (128, 256), (256, 300)]
    >>> tile_bounds(6, per=3)
    [(0, 3), (3, 6)]
    """
    per = per or length
    return [(start + lo, start + min(per, lo + BLOCK))
            for start in range(0, length, per) for lo in range(0, per, BLOCK)]


def layout_problem(widths, tp: int, seq_length: int, cp: int, cp_parts: int) -> str | None:
    """Why a layout would cut a tile, or None: every width TP splits (``widths``: (what, logical
    width) pairs) must leave each rank whole 128-wide tiles, and each of the sequence's
    ``cp_parts`` context-parallel chunks (2 cp for the ring, cp for a2a) whole 128-token tiles; a
    tile cut by a shard boundary would get another scale than the serial run's tile. The
    configuration asks it (engine/config/fp8.py ``blockwise_problem``).

    >>> layout_problem([("--hidden-size", 256)], 2, 256, 1, 1) is None
    True
    >>> print(layout_problem([], 1, 256, 2, 4).split(";")[0])
    --fp8-recipe blockwise at --cp 2 needs each of the sequence's 4 context-parallel chunks (256 / 4 tokens) to be a multiple of 128, the weight gradient's token tiles
    """
    if tp > 1:
        for what, width in widths:
            if width % (tp * BLOCK):
                return (f"--fp8-recipe blockwise at --tp {tp} needs each rank's share of {what} "
                        f"({width} / {tp}) to be a multiple of {BLOCK}, so that every scale "
                        f"tile is whole on one rank; make it a multiple of {tp * BLOCK}, or use "
                        f"--fp8-recipe rowwise")
    if cp > 1 and seq_length % (cp_parts * BLOCK):
        return (f"--fp8-recipe blockwise at --cp {cp} needs each of the sequence's {cp_parts} "
                f"context-parallel chunks ({seq_length} / {cp_parts} tokens) to be a multiple of "
                f"{BLOCK}, the weight gradient's token tiles; use a --seq-length that is a multiple "
                f"of {cp_parts * BLOCK}, or --fp8-recipe rowwise")
    return None


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zeros appended along ``dim`` to a multiple of 128 (a zero changes no amax)."""
    extra = -x.shape[dim] % BLOCK
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax_to_scale(amax, E4M3, power_of_two=True)


def row_tile_scales(x: torch.Tensor) -> torch.Tensor:
    """(M, K) -> (M, ceil(K/128)): the quantization scale of each 1 x 128 tile of each row."""
    m = x.shape[0]
    tiles = _pad(x, 1).reshape(m, -1, BLOCK)                               # (M, K/128, 128)
    return _scale(tiles.abs().amax(-1).float())


def block_scales(w: torch.Tensor) -> torch.Tensor:
    """(R, C) -> (ceil(R/128), ceil(C/128)): the scale of each 128 x 128 block."""
    blocks = _pad(_pad(w, 0), 1)
    r, c = blocks.shape
    blocks = blocks.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    return _scale(blocks.abs().amax(dim=(1, 3)).float())


def token_tile_scales(t: torch.Tensor) -> torch.Tensor:
    """(b, s, n) -> (b * ceil(s/128), n): the scale of each 128 x 1 tile of each column, cut per
    sequence (``tile_bounds(b * s, per=s)`` order)."""
    b, _, n = t.shape
    tiles = _pad(t, 1).reshape(b, -1, BLOCK, n)                            # (b, S/128, 128, n)
    return _scale(tiles.abs().amax(2).float()).reshape(-1, n)


def expand(scale: torch.Tensor, dim: int, length: int, per: int | None = None) -> torch.Tensor:
    """Per-tile scales repeated over each tile's elements along ``dim`` (``length`` of them, in
    ``tile_bounds(length, per)``'s tiles; no host read)."""
    per = per or length
    tiles = -(-per // BLOCK)
    moved = scale.movedim(dim, 0)                                   # (groups * tiles, ...)
    rest = moved.shape[1:]
    full = moved.reshape(length // per, tiles, *rest).repeat_interleave(BLOCK, dim=1)[:, :per]
    return full.reshape(length, *rest).movedim(0, dim)


def quantize_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, K) in e4m3 with 1 x 128 tile scales (M, ceil(K/128)) (broadcast over each tile: no
    expanded copy of the scales)."""
    m, k = x.shape
    q = quantize(_pad(x, 1).reshape(m, -1, BLOCK), scale.unsqueeze(-1), E4M3)  # (M, K/128, 128)
    return q.reshape(m, -1)[:, :k].contiguous()


def quantize_blocks(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(R, C) in e4m3 with 128 x 128 block scales."""
    r, c = w.shape
    padded = _pad(_pad(w, 0), 1)
    blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    q = quantize(blocks, scale[:, None, :, None], E4M3).reshape(padded.shape)
    return q[:r, :c].contiguous()


def quantize_token_tiles(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(b, s, n) -> (b * s, n) in e4m3 with the 128 x 1 token tile scales of ``token_tile_scales``."""
    b, s, n = t.shape
    tiles = _pad(t, 1).reshape(b, -1, BLOCK, n)                            # (b, S/128, 128, n)
    q = quantize(tiles, scale.view(b, -1, 1, n), E4M3).reshape(b, -1, n)
    return q[:, :s].reshape(b * s, n)


def blockwise_mm_reference(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor,
                           inv_b: torch.Tensor, out_dtype: torch.dtype,
                           per: int | None = None) -> torch.Tensor:
    """a (M, K), b (K, N) float8; inv_a (M, T) and inv_b (T, N) the dequantization scales of the T
    K tiles ``tile_bounds(K, per)``: (a * inv_a) @ (b * inv_b) in fp32, cast to ``out_dtype``."""
    k = a.shape[1]
    da = a.float() * expand(inv_a, 1, k, per)
    db = b.float() * expand(inv_b, 0, k, per)
    return (da @ db).to(out_dtype)


def graded_operands(tokens: int, hidden: int, device, spread: int = 9, seed: int = 0):
    """(x (1, tokens, hidden), W (hidden, hidden), dy (1, tokens, hidden)) in bf16 whose 128-wide
    tiles differ in magnitude by 2^(2 spread) from their neighbours, inversely in the operand they
    meet: x 2^(a_k + t_j), W 2^(-a_k - c_o), dy 2^(c_o - t_j) for feature tile k, output tile o,
    token tile j, with a, c, t alternating +-spread. Every tile then adds alike to every GEMM's
    sums, and with 2 spread beyond e4m3's range (2^15) a scale read for another tile flushes or
    saturates that tile's share: a misplaced scale cannot hide."""
    g = torch.Generator().manual_seed(seed)

    def sign(n: int, first: int) -> torch.Tensor:   # +-first, alternating over n's tiles
        return torch.tensor([first * (-1) ** i for i in range(-(-n // BLOCK))], dtype=torch.float32)

    def along(e: torch.Tensor, n: int) -> torch.Tensor:   # 2^e per tile, over n elements
        return torch.exp2(e).repeat_interleave(BLOCK)[:n]
    a, c, t = sign(hidden, spread), sign(hidden, -(spread - 1)), sign(tokens, spread)
    x = torch.randn(1, tokens, hidden, generator=g) * along(a, hidden) * along(t, tokens)[:, None]
    w = torch.randn(hidden, hidden, generator=g) * along(-c, hidden)[:, None] * along(-a, hidden)
    dy = torch.randn(1, tokens, hidden, generator=g) * along(c, hidden) * along(-t, tokens)[:, None]
    return tuple(v.to(device=device, dtype=torch.bfloat16) for v in (x, w, dy))


def block_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of any 128 x 128 block over that block's largest |want| (rows: the
    tokens of a (..., n) tensor), so that a block of small values is judged on its own scale."""
    got, want = got.float().reshape(-1, got.shape[-1]), want.float().reshape(-1, want.shape[-1])
    worst = 0.0
    for r in range(0, got.shape[0], BLOCK):
        for c in range(0, got.shape[1], BLOCK):
            g, w = got[r:r + BLOCK, c:c + BLOCK], want[r:r + BLOCK, c:c + BLOCK]
            err = float((g - w).abs().max() / w.abs().max().clamp(min=1e-30))
            worst = max(worst, err if err == err else float("inf"))   # a NaN block: no agreement
    return worst
