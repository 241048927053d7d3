"""Blockwise FP8 GEMMs (DeepSeek-V3's recipe, ``--fp8-recipe blockwise``): one scale per 1 x 128
tile of an activation or gradient along the GEMM's contraction dimension, one per 128 x 128 block
of a weight, each with its reference.

The three GEMMs of a linear layer y = x W^T (x (b, s, in), W (out, in)), the tiles of each operand
running along that GEMM's contraction dimension K:

    forward          y  = x W^T     x  1 x 128 along in        W  128 x 128 (the same blocks
    input gradient   dx = dy W      dy 1 x 128 along out       W  128 x 128  serve both GEMMs)
    weight gradient  dW = dy^T x    dy 128 x 1 along tokens    x  128 x 1 along tokens

Token tiles are cut per sequence (positions 0-127, 128-255, ... of each sample), so a tile never
mixes two samples and the tiles of a sequence shard (context parallelism: chunks of 128 tokens
and multiples) are the serial run's. A dimension that is not a multiple of 128 ends in a partial
tile. Scales are ``kernels.fp8.amax_to_scale`` of each tile's amax, rounded down to a power of
two (as the rowwise recipe), and every operand is e4m3 (PyTorch's blockwise kernel takes e4m3
only, and DeepSeek-V3 trains so: the tiles give each gradient tile its own range).

A scale is local to its tile, so nothing is reduced over a group: where TP or CP shards a
dimension in multiples of 128 (``engine.config.fp8`` refuses the rest), each rank's tiles are
tiles of the serial tensor with the serial scales.

Paths (``blockwise_mm``), the same choice on every device as ``kernels.fp8.scaled_mm`` makes:

- ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128`` scales, where
  ``fused_blockwise_runs(device type)`` (a start-up probe: two small products against the per-block
  path below, within bf16 rounding) says the installed torch runs them (CUDA sm90 with cuBLAS 12.9
  or later) and every dimension is whole tiles. Not measured: no such device ran this code yet.
- elsewhere (the CPU: torch 2.13 refuses blockwise scales there) the SAME quantized operands one
  K tile at a time: each tile's product is ``kernels.fp8.scaled_mm`` with rowwise scales (the
  tile's (M, 1) column of A's scales, its (1, N) row of B's), a real FP8 GEMM on ``torch._scaled_mm``
  with a bf16 output, the tiles' products summed in fp32. Each product is rounded to bf16 once
  before the sum (rowwise ``_scaled_mm`` returns bf16 only): tests/kernels/test_fp8_blockwise.py
  bounds what that costs against the reference.

``blockwise_mm_reference`` dequantizes both operands tile by tile and multiplies in fp32: the
definition both paths are held to.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.fp8 import E4M3, amax_to_scale, quantize, scaled_mm

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


def _per_tile(a, b, inv_a, inv_b, bounds, out_dtype, fast_accum) -> torch.Tensor:
    out = None
    for j, (lo, hi) in enumerate(bounds):
        part = scaled_mm(a[:, lo:hi], b[lo:hi], inv_a[:, j].contiguous().view(-1, 1),
                         inv_b[j].contiguous().view(1, -1), torch.bfloat16,
                         fast_accum=fast_accum).float()
        out = part if out is None else out.add_(part)
    return out.to(out_dtype)


def _fused(a, b, inv_a, inv_b_compact, b_blocks: bool, out_dtype, fast_accum) -> torch.Tensor:
    """F.scaled_mm's blockwise kernel, the scales laid out as torch 2.13's rules for it say
    (``torch._meta_registrations``, ``_scaled_mm_v2``): A's 1 x 128 scales (M, K/128) outer-dim
    major, stride (1, M); B's 128 x 128 scales (round_up(K/128, 4), N/128), stride (1, that), the
    K tiles zero-padded to a multiple of 4; or B's 1 x 128 scales as (N, K/128), stride (1, N)."""
    recipe = F.ScalingType
    sa = inv_a.t().contiguous().t()                                         # (M, T), (1, M)
    if b_blocks:
        t, nb = inv_b_compact.shape
        sb = inv_b_compact.new_zeros(nb, -(-t // 4) * 4)
        sb[:, :t] = inv_b_compact.t()
        sb = sb.t()                                                         # (L4, N/128), (1, L4)
    else:
        sb = inv_b_compact.contiguous().t()                                 # (N, T), (1, N)
    return F.scaled_mm(a, b, sa, recipe.BlockWise1x128, sb,
                       recipe.BlockWise128x128 if b_blocks else recipe.BlockWise1x128,
                       output_dtype=out_dtype, use_fast_accum=fast_accum)


def linear(x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
           bias: torch.Tensor | None = None, fused: bool | None = None) -> torch.Tensor:
    """The forward GEMM: (..., in) x, (out, in) W with its ``block_scales`` -> (..., out) in x's
    dtype, + bias (in that dtype, after the GEMM); fast accumulation, as the other recipes'."""
    x2 = x.reshape(-1, x.shape[-1])                                          # (M, in)
    s_x = row_tile_scales(x2)
    inv_w = w_scales.reciprocal().t()                          # (in tiles, out blocks)
    out = blockwise_mm(quantize_rows(x2, s_x), quantize_blocks(w, w_scales).t(),
                       s_x.reciprocal(), expand(inv_w, 1, w.shape[0]), x.dtype, b_blocks=inv_w,
                       fast_accum=True, fused=fused)                         # (M, out)
    out = out.view(*x.shape[:-1], w.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


def dgrad(g: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
          fused: bool | None = None) -> torch.Tensor:
    """The input gradient: (..., out) dy, W (out, in) with the forward's block scales -> (..., in)."""
    g2 = g.reshape(-1, g.shape[-1])                                          # (M, out)
    s_g = row_tile_scales(g2)
    inv_w = w_scales.reciprocal()                              # (out tiles, in blocks)
    b = quantize_blocks(w, w_scales).t().contiguous().t()      # (out, in) column-major
    out = blockwise_mm(quantize_rows(g2, s_g), b, s_g.reciprocal(), expand(inv_w, 1, w.shape[1]),
                       g.dtype, b_blocks=inv_w, fused=fused)
    return out.view(*g.shape[:-1], w.shape[1])


def wgrad(g: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype,
          fused: bool | None = None) -> torch.Tensor:
    """The weight gradient dy^T x: (b, s, out) and (b, s, in) -> (out, in), token tiles cut per
    sequence of s (a 2-d pair is one sequence)."""
    s = g.shape[-2] if g.dim() > 2 else g.shape[0]
    g3, x3 = g.reshape(-1, s, g.shape[-1]), x.reshape(-1, s, x.shape[-1])
    s_g, s_x = token_tile_scales(g3), token_tile_scales(x3)                  # (T, out), (T, in)
    a = quantize_token_tiles(g3, s_g).t().contiguous()                       # (out, M) row-major
    b = quantize_token_tiles(x3, s_x).t().contiguous().t()                   # (M, in) column-major
    return blockwise_mm(a, b, s_g.reciprocal().t(), s_x.reciprocal(), out_dtype, per=s,
                        fused=fused)


def _whole_tiles(*sizes: int) -> bool:
    return all(n % BLOCK == 0 for n in sizes)


def blockwise_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
                 out_dtype: torch.dtype, per: int | None = None,
                 b_blocks: torch.Tensor | None = None, fast_accum: bool = False,
                 fused: bool | None = None) -> torch.Tensor:
    """a (M, K) e4m3 row-major, b (K, N) e4m3 column-major, dequantization scales inv_a (M, T)
    and inv_b (T, N) of the K tiles ``tile_bounds(K, per)`` -> (M, N) in ``out_dtype``.
    ``b_blocks``: b's 128 x 128 dequantization scales (T, N/128) where b is a weight (the fused
    kernel takes those, not their expansion). ``fused``: force the fused kernel (True, where the
    shapes are whole tiles) or the per-tile path (False); None: the probe decides."""
    m, k = a.shape
    n = b.shape[1]
    if fused is None:
        fused = fused_blockwise_runs(a.device.type)
    if fused and _whole_tiles(m, k, n, per or k) and out_dtype == torch.bfloat16:
        return _fused(a, b, inv_a, inv_b if b_blocks is None else b_blocks, b_blocks is not None,
                      out_dtype, fast_accum)
    return _per_tile(a, b, inv_a, inv_b, tile_bounds(k, per), out_dtype, fast_accum)


def graded_operands(tokens: int, hidden: int, device, spread: int = 9, seed: int = 0):
    """(x (1, tokens, hidden), W (hidden, hidden), dy (1, tokens, hidden)) in bf16 whose 128-wide
    tiles differ in magnitude by 2^(2 spread) from their neighbours, inversely in the operand they
    meet: x 2^(a_k + t_j), W 2^(-a_k - c_o), dy 2^(c_o - t_j) for feature tile k, output tile o,
    token tile j, with a, c, t alternating +-spread. Every tile then adds alike to every GEMM's
    sums, and with 2 spread beyond e4m3's range (2^15) a scale read for another tile flushes or
    saturates that tile's share: a misplaced scale cannot hide."""
    g = torch.Generator().manual_seed(seed)
    sign = lambda n, first: torch.tensor([first * (-1) ** i for i in range(-(-n // BLOCK))],  # noqa: E731
                                         dtype=torch.float32)
    along = lambda e, n: torch.exp2(e).repeat_interleave(BLOCK)[:n]        # noqa: E731
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
            worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp(min=1e-30)))
    return worst


PROBE_TOLERANCE = 2.0 ** -6   # fused (fp32 accumulation) against per-tile (bf16 products)


def fused_agrees(device_type: str) -> bool:
    """The three GEMMs of a 256-wide linear on ``graded_operands`` through the fused kernel and
    through the per-tile path: every 128 x 128 block of each result within ``PROBE_TOLERANCE`` of
    the other's (a scale layout the kernel reads otherwise than ``_fused`` writes it is off by
    2^18 somewhere)."""
    x, w, dy = graded_operands(256, 256, device_type)
    sw = block_scales(w)
    for run in (lambda f: linear(x, w, sw, fused=f), lambda f: dgrad(dy, w, sw, fused=f),
                lambda f: wgrad(dy, x, torch.bfloat16, fused=f)):
        if block_error(run(True), run(False)) > PROBE_TOLERANCE:
            return False
    return True


@functools.lru_cache(maxsize=None)   # a fact about the installed torch and the device type
def fused_blockwise_runs(device_type: str) -> bool:
    """Whether F.scaled_mm's blockwise kernel runs here and ``fused_agrees``: outside any dispatch
    mode (a FLOP counter, the wait counter: not the caller's work); a refusal means no."""
    if device_type in ("cpu", "meta") or not hasattr(F, "ScalingType"):
        return False   # torch 2.13's CPU kernel takes tensorwise and rowwise scales only; the
        #                meta device (the dry run) has no values to compare
    from torch.utils._python_dispatch import _disable_current_modes
    try:
        with _disable_current_modes():
            return fused_agrees(device_type)
    except Exception:  # noqa: BLE001 - any refusal (no kernel, no such scaling) means no
        return False


def blockwise_path(device_type: str) -> str:
    """The start-up line naming the blockwise GEMMs' path on this device type (probing it)."""
    if fused_blockwise_runs(device_type):
        return (f"--fp8-recipe blockwise: PyTorch's blockwise FP8 kernel "
                f"(torch.nn.functional.scaled_mm) on {device_type}")
    return (f"--fp8-recipe blockwise: no blockwise FP8 kernel on {device_type} with this torch, "
            f"so each GEMM runs one rowwise FP8 GEMM per 128-wide tile of its contraction "
            f"(the same quantized operands, each tile's product rounded to bf16 before the fp32 sum; slower than one kernel)")
