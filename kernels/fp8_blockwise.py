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
two (as the rowwise recipe; the tiles, scales and quantization: kernels/fp8_tiles.py), and every
operand is e4m3 (PyTorch's blockwise kernel takes e4m3
only, and DeepSeek-V3 trains so: the tiles give each gradient tile its own range).

A scale is local to its tile, so nothing is reduced over a group: where TP or CP shards a
dimension in multiples of 128 (``engine.config.fp8`` refuses the rest), each rank's tiles are
tiles of the serial tensor with the serial scales.

Paths (``blockwise_mm``), the same choice on every device as ``kernels.fp8.scaled_mm`` makes:

- ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128`` scales, where
  ``fused_blockwise_runs(device type)`` (a start-up probe: the three GEMMs of a 256-wide linear on
  graded operands through both paths, every 128 x 128 block within the probe's tolerance of its
  largest element) says the installed torch runs them and reads the scales as laid out here
  (CUDA sm90 with cuBLAS 12.9 or later), and every dimension is whole tiles. Not measured: no such
  device ran this code yet.
- elsewhere (the CPU: torch 2.13 refuses blockwise scales there) the SAME quantized operands one
  K tile at a time: each tile's product is ``kernels.fp8.scaled_mm`` with rowwise scales (the
  tile's (M, 1) column of A's scales, its (1, N) row of B's), a real FP8 GEMM on ``torch._scaled_mm``
  with a bf16 output, the tiles' products summed in fp32. Each product is rounded to bf16 once
  before the sum (rowwise ``_scaled_mm`` returns bf16 only): tests/kernels/test_fp8_blockwise.py
  bounds what that costs against the reference.

``kernels.fp8_tiles.blockwise_mm_reference`` dequantizes both operands tile by tile and
multiplies in fp32: the definition both paths are held to.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.fp8 import scaled_mm
from kernels.fp8_tiles import (BLOCK, block_error, block_scales, expand, graded_operands,
                               quantize_blocks, quantize_rows, quantize_token_tiles,
                               row_tile_scales, tile_bounds, token_tile_scales)


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
                       s_x.reciprocal(), None, x.dtype, b_blocks=inv_w, fast_accum=True,
                       fused=fused)                                          # (M, out)
    out = out.view(*x.shape[:-1], w.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


def dgrad(g: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
          fused: bool | None = None) -> torch.Tensor:
    """The input gradient: (..., out) dy, W (out, in) with the forward's block scales -> (..., in)."""
    g2 = g.reshape(-1, g.shape[-1])                                          # (M, out)
    s_g = row_tile_scales(g2)
    inv_w = w_scales.reciprocal()                              # (out tiles, in blocks)
    b = quantize_blocks(w, w_scales).t().contiguous().t()      # (out, in) column-major
    out = blockwise_mm(quantize_rows(g2, s_g), b, s_g.reciprocal(), None, g.dtype,
                       b_blocks=inv_w, fused=fused)
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


def blockwise_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor,
                 inv_b: torch.Tensor | None, out_dtype: torch.dtype, per: int | None = None,
                 b_blocks: torch.Tensor | None = None, fast_accum: bool = False,
                 fused: bool | None = None) -> torch.Tensor:
    """a (M, K) e4m3 row-major, b (K, N) e4m3 column-major, dequantization scales inv_a (M, T)
    and inv_b (T, N) of the K tiles ``tile_bounds(K, per)`` -> (M, N) in ``out_dtype``.
    ``b_blocks``: b's 128 x 128 dequantization scales (T, N/128) where b is a weight (the fused
    kernel takes those; ``inv_b`` None: expanded from them for the per-tile path only).
    ``fused``: force the fused kernel (True, where the shapes are whole tiles) or the per-tile
    path (False); None: the probe decides."""
    m, k = a.shape
    n = b.shape[1]
    if fused is None:
        fused = fused_blockwise_runs(a.device.type)
    if fused and _whole_tiles(m, k, n, per or k) and out_dtype == torch.bfloat16:
        return _fused(a, b, inv_a, inv_b if b_blocks is None else b_blocks, b_blocks is not None,
                      out_dtype, fast_accum)
    if inv_b is None:
        inv_b = expand(b_blocks, 1, n)                                       # (T, N)
    return _per_tile(a, b, inv_a, inv_b, tile_bounds(k, per), out_dtype, fast_accum)


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
def fused_blockwise_probe(device_type: str) -> str | None:
    """None where F.scaled_mm's blockwise kernel runs here and ``fused_agrees``, else why not (no
    kernel on this device, the error it raised, or its disagreement with the per-tile path). Run
    outside any dispatch mode (a FLOP counter, the wait counter: not the caller's work)."""
    if device_type in ("cpu", "meta") or not hasattr(F, "ScalingType"):
        return "no blockwise FP8 kernel"   # torch 2.13's CPU kernel: tensorwise and rowwise only
    from torch.utils._python_dispatch import _disable_current_modes
    try:
        with _disable_current_modes():
            if fused_agrees(device_type):
                return None
            return "its blockwise FP8 kernel disagreed with the per-tile path at start-up"
    except Exception as exc:  # noqa: BLE001 - a refusal (no kernel, no such scaling) is a no
        return (f"its blockwise FP8 kernel raised {type(exc).__name__}: "
                + (str(exc).strip().splitlines() or [""])[-1][:160])


def fused_blockwise_runs(device_type: str) -> bool:
    """Whether the blockwise GEMMs take the fused kernel here (``fused_blockwise_probe``)."""
    return fused_blockwise_probe(device_type) is None


def blockwise_path(device_type: str) -> str:
    """The start-up line naming the blockwise GEMMs' path on this device type (probing it)."""
    why = fused_blockwise_probe(device_type)
    if why is None:
        return (f"--fp8-recipe blockwise: PyTorch's blockwise FP8 kernel "
                f"(torch.nn.functional.scaled_mm) on {device_type}")
    return (f"--fp8-recipe blockwise: {why} on {device_type} with this torch, so each GEMM runs "
            f"one rowwise FP8 GEMM per 128-wide tile of its contraction (the same quantized "
            f"operands, each tile's product rounded to bf16 before the fp32 sum; slower than one "
            f"kernel)")
