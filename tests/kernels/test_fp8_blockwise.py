"""kernels/fp8_blockwise.py and kernels/fp8_tiles.py: DeepSeek-V3's blockwise FP8 GEMMs against
their definition.

The per-tile path runs torch 2.13's CPU ``torch._scaled_mm`` (counted), one rowwise FP8 GEMM per
128-wide K tile, each rounded to bf16 before the fp32 sum: it may differ from the reference (the
dequantized operands multiplied in fp32) by one bf16 rounding of each tile's product, 2^-8 of
sum_j |P_j| per element, plus fp32 reassociation. The operands are drawn with magnitudes that
differ by powers of two from tile to tile and block to block, so a scale applied to the wrong
tile saturates or flushes elements and misses the bounds by far. The fused kernel
(``F.scaled_mm`` with blockwise scales) has no CPU implementation: its scale layouts are checked
against torch's own rules on the meta device.
"""
from __future__ import annotations

import doctest

import pytest
import torch

from kernels import fp8_blockwise as bw
from kernels import fp8_tiles
from kernels.fp8 import E4M3, amax_to_scale, fp8_max, quantize
from tests.kernels.test_fp8 import CountScaledMM

BF16_ULP = 2.0 ** -8
E4M3_STEP = 2.0 ** -3     # e4m3's relative spacing: 3 mantissa bits (normal numbers)


def _tiled(shape, tile_dims, seed=0) -> torch.Tensor:
    """Gaussian values scaled by 2^k, k drawn per 128-wide tile along ``tile_dims``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    for d in tile_dims:
        tiles = -(-shape[d] // fp8_tiles.BLOCK)
        k = torch.randint(-6, 7, (tiles,), generator=g).float()
        scale = torch.exp2(k).repeat_interleave(fp8_tiles.BLOCK)[:shape[d]]
        view = [1] * len(shape)
        view[d] = shape[d]
        x = x * scale.view(view)
    return x


def test_worked_examples():
    failed, tried = doctest.testmod(fp8_tiles)
    assert tried > 0 and failed == 0


def test_tile_scales_are_each_tiles_own():
    """Each scale is the power-of-two e4m3 scale of its tile's amax (partial last tiles too), and
    the tiles of a shard cut at a multiple of 128 are the whole tensor's tiles."""
    x = _tiled((5, 300), [1])
    s = fp8_tiles.row_tile_scales(x)
    assert s.shape == (5, 3)
    for j, (lo, hi) in enumerate(fp8_tiles.tile_bounds(300)):
        want = amax_to_scale(x[:, lo:hi].abs().amax(1), E4M3, power_of_two=True)
        assert torch.equal(s[:, j], want)
    assert torch.equal(fp8_tiles.row_tile_scales(x[:, 128:]), s[:, 1:])          # a TP shard's tiles
    w = _tiled((260, 200), [0, 1], seed=1)
    sw = fp8_tiles.block_scales(w)
    assert sw.shape == (3, 2)
    assert sw[2, 1] == amax_to_scale(w[256:, 128:].abs().max(), E4M3, power_of_two=True)
    assert torch.equal(fp8_tiles.block_scales(w[128:]), sw[1:])
    t = _tiled((2, 200, 6), [1], seed=2)                                   # (b, s, n)
    st = fp8_tiles.token_tile_scales(t)                                           # tiles cut per sequence
    per_sample = torch.cat([fp8_tiles.token_tile_scales(t[i:i + 1]) for i in range(2)])
    assert st.shape == (4, 6) and torch.equal(st, per_sample)
    assert torch.equal(st[1], amax_to_scale(t[0, 128:].abs().amax(0), E4M3, power_of_two=True))
    chunk = fp8_tiles.token_tile_scales(t[:, 128:])                               # a CP chunk from 128
    assert torch.equal(chunk, st[[1, 3]])


def test_quantization_applies_each_tiles_scale():
    x = _tiled((3, 300), [1], seed=3)
    s = fp8_tiles.row_tile_scales(x)
    q = fp8_tiles.quantize_rows(x, s)
    for j, (lo, hi) in enumerate(fp8_tiles.tile_bounds(300)):
        assert torch.equal(q[:, lo:hi].view(torch.uint8),
                           quantize(x[:, lo:hi], s[:, j:j + 1], E4M3).view(torch.uint8))
    assert q.float().abs().max() <= fp8_max(E4M3)
    w = _tiled((200, 260), [0, 1], seed=4)
    sw = fp8_tiles.block_scales(w)
    qw = fp8_tiles.quantize_blocks(w, sw)
    assert torch.equal(qw[128:, 256:].view(torch.uint8),
                       quantize(w[128:, 256:], sw[1, 2], E4M3).view(torch.uint8))


@pytest.mark.parametrize("m,k,n,per", [(48, 256, 64, None), (40, 300, 48, None),
                                       (64, 2 * 96, 32, 96)],
                         ids=["whole tiles", "partial tile", "per sequence"])
def test_per_tile_path_runs_scaled_mm_and_matches_the_reference(m, k, n, per):
    x = _tiled((m, k), [1], seed=5)
    y = _tiled((k, n), [0], seed=6)
    sx = fp8_tiles.row_tile_scales(x) if per is None else None
    if per is None:
        a = fp8_tiles.quantize_rows(x, sx)
        inv_a = sx.reciprocal()
    else:   # the weight gradient's token tiles: x^T's rows are columns cut per sequence
        st = fp8_tiles.token_tile_scales(x.t().reshape(1, -1, m).reshape(k // per, per, m))
        a = fp8_tiles.quantize_token_tiles(x.t().reshape(k // per, per, m), st).t().contiguous()
        inv_a = st.reciprocal().t()
    sy = fp8_tiles.token_tile_scales(y.reshape(k // (per or k), per or k, n))
    b = fp8_tiles.quantize_token_tiles(y.reshape(k // (per or k), per or k, n), sy).t().contiguous().t()
    inv_b = sy.reciprocal()
    with CountScaledMM() as counter:
        got = bw.blockwise_mm(a, b, inv_a, inv_b, torch.float32, per=per)
    tiles = fp8_tiles.tile_bounds(k, per)
    assert counter.calls == sum((hi - lo) % 16 == 0 for lo, hi in tiles) > 0
    want = fp8_tiles.blockwise_mm_reference(a, b, inv_a, inv_b, torch.float32, per=per)
    parts = sum(fp8_tiles.blockwise_mm_reference(a[:, lo:hi], b[lo:hi], inv_a[:, j:j + 1],
                                          inv_b[j:j + 1], torch.float32).abs()
                for j, (lo, hi) in enumerate(tiles))
    bound = BF16_ULP * parts + 1e-5 * want.abs().max()
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0        # the bf16 rounding of each tile is there


def test_layer_gemms_are_the_products_within_e4m3_rounding():
    """linear, dgrad and wgrad against the exact fp32 products: each element of each operand is
    within half an e4m3 step of its value (tile scales keep every tile in range), so each product
    is within (2 * 2^-4 + 2^-8) sum |a||b| of the exact one. A scale applied to another tile (the
    magnitudes differ by up to 2^12 between tiles) breaks the bound."""
    b_, s, i, o = 2, 160, 256, 384
    x = _tiled((b_, s, i), [2], seed=7).bfloat16()
    w = _tiled((o, i), [0, 1], seed=8).bfloat16()
    g = _tiled((b_, s, o), [2], seed=9).bfloat16()
    rel = 2 * E4M3_STEP / 2 + BF16_ULP

    def close(got, a, bmat):
        exact = a.float() @ bmat.float()
        bound = rel * (a.float().abs() @ bmat.float().abs()) + 1e-6
        assert ((got.float() - exact).abs() <= bound).all()
        assert ((got.float() - exact).abs() > 0).any()

    sw = fp8_tiles.block_scales(w)
    y = bw.linear(x, w, sw)
    assert y.shape == (b_, s, o) and y.dtype == torch.bfloat16
    close(y.reshape(-1, o), x.reshape(-1, i), w.t())
    dx = bw.dgrad(g, w, sw)
    close(dx.reshape(-1, i), g.reshape(-1, o), w)
    dw = bw.wgrad(g, x, torch.float32)
    close(dw, g.reshape(-1, o).t(), x.reshape(-1, i))
    bias = torch.randn(o).bfloat16()
    assert torch.equal(bw.linear(x, w, sw, bias), y + bias)


def test_no_fused_kernel_on_the_cpu():
    assert not bw.fused_blockwise_runs("cpu")
    assert "one rowwise FP8 GEMM per 128-wide tile" in bw.blockwise_path("cpu")


@pytest.mark.parametrize("b_blocks", [True, False], ids=["1x128 by 128x128", "1x128 by 1x128"])
def test_fused_call_lays_out_scales_as_torch_rules_say(b_blocks):
    """torch 2.13's meta kernel of ``_scaled_mm_v2`` checks the blockwise scales' shapes and
    strides (K = 640: five K tiles, padded to eight for the 128 x 128 scales); a layout it does not
    take raises."""
    m, k, n = 256, 640, 384
    a = torch.empty(m, k, device="meta", dtype=E4M3)
    b = torch.empty(n, k, device="meta", dtype=E4M3).t()                   # column-major
    inv_a = torch.empty(m, k // 128, device="meta")
    inv_b = torch.empty(k // 128, n // 128 if b_blocks else n, device="meta")
    out = bw._fused(a, b, inv_a, inv_b, b_blocks, torch.bfloat16, False)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError):   # the compact (unpadded, row-major) layout is refused
        torch.nn.functional.scaled_mm(
            a, b, inv_a.t().contiguous().t(), torch.nn.functional.ScalingType.BlockWise1x128,
            inv_b, torch.nn.functional.ScalingType.BlockWise128x128 if b_blocks
            else torch.nn.functional.ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)


def _stand_in(misread: str | None):
    """F.scaled_mm's blockwise kernel, which no CPU runs, as the reference reading its scales as
    ``_fused`` lays them out (``misread`` None), or reading them otherwise: B's 128 x 128 blocks
    transposed, or A's tiles shifted by one: what a torch with other layout rules would do; or
    returning NaN."""
    def fused(a, b, inv_a, inv_b_compact, b_blocks, out_dtype, fast_accum):
        if misread == "nan":   # a kernel that returns garbage agrees with nothing
            return torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype)
        if misread == "a" or (misread == "b" and not b_blocks):
            inv_a = inv_a.roll(1, dims=1)
        if b_blocks:
            compact = inv_b_compact.t() if misread == "b" else inv_b_compact
            inv_b = fp8_tiles.expand(compact, 1, b.shape[1])
        else:
            inv_b = inv_b_compact
        return fp8_tiles.blockwise_mm_reference(a, b, inv_a, inv_b, out_dtype)
    return fused


@pytest.mark.parametrize("misread", [None, "a", "b", "nan"],
                         ids=["as laid out", "A's tiles", "B's blocks", "NaN"])
def test_the_probe_sees_a_kernel_that_reads_scales_otherwise(monkeypatch, misread):
    """``fused_agrees`` (the start-up probe's comparison) on graded operands, whose neighbouring
    tiles differ by 2^18: a kernel reading the scales as laid out agrees with the per-tile path;
    one reading them otherwise is refused (with operands of like tiles, as randn draws them, the
    scales would all be equal and any reading would agree)."""
    monkeypatch.setattr(bw, "_fused", _stand_in(misread))
    assert bw.fused_agrees("cpu") is (misread is None)
    assert fp8_tiles.block_error(torch.full((4, 4), float("nan")), torch.ones(4, 4)) == float("inf")
    x, w, _ = fp8_tiles.graded_operands(256, 256, "cpu")
    s = fp8_tiles.block_scales(w)
    assert s[0, 0] != s[0, 1] and s[0, 0] != s[1, 0] and s[0, 1] != s[1, 0]  # no two alike


def test_weight_gradient_tiles_are_cut_per_sequence():
    """dW = dy^T x over two sequences of 160 tokens: tiles 0-127 and 128-159 of each. x's token
    tiles and dy's are 2^18 apart and inverse (x 2^(9 e), dy 2^(-9 e) with e = +1, -1 per tile), so
    every tile adds alike to dW and a tile cut across the two sequences (128-255 of the flattened
    tokens: the first one's 32 small ones with the second one's 96 large ones) would share one
    scale, flush the small part and miss e4m3's bound by far."""
    g = torch.Generator().manual_seed(11)
    e = torch.tensor([9.0] * 128 + [-9.0] * 32)                            # (s,) per-token exponent
    x = (torch.randn(2, 160, 64, generator=g) * torch.exp2(e)[:, None]).bfloat16()
    dy = (torch.randn(2, 160, 96, generator=g) * torch.exp2(-e)[:, None]).bfloat16()
    got = bw.wgrad(dy, x, torch.float32)
    a, b = dy.float().reshape(-1, 96).t(), x.float().reshape(-1, 64)
    exact = a @ b
    bound = (2 * E4M3_STEP / 2 + BF16_ULP) * (a.abs() @ b.abs())
    assert ((got - exact).abs() <= bound).all()
    flattened = fp8_tiles.blockwise_mm_reference(   # the same operands cut in flat 128-token tiles
        *_flat_tiles(dy.reshape(1, 320, 96), x.reshape(1, 320, 64)), torch.float32)
    assert ((flattened - exact).abs() > bound).any()   # what the per-sequence cut avoids


def _flat_tiles(g, x):
    """dy^T and x quantized with 128-token tiles over the flattened tokens (not per sequence)."""
    sg, sx = fp8_tiles.token_tile_scales(g), fp8_tiles.token_tile_scales(x)
    a = fp8_tiles.quantize_token_tiles(g, sg).t().contiguous()
    b = fp8_tiles.quantize_token_tiles(x, sx)
    return a, b, sg.reciprocal().t(), sx.reciprocal()
