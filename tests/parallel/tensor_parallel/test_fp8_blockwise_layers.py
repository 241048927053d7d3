"""``--fp8-recipe blockwise`` in the tensor-parallel layers: every path on a real tp=2 x cp=2 gloo
group against the serial blockwise layer.

Operands are drawn with magnitudes that differ by 2^16 to 2^18 from one 128-wide tile (weights:
128 x 128 block) to the next, along features and along tokens (more than e4m3's normal range,
2^15: a power-of-two scale shared by two such tiles pushes the smaller into subnormals or to zero,
where one shared by tiles of like magnitude would only shift exponents), and inversely in the
operand they meet, so every tile contributes alike to every GEMM's sums: x 2^(a_k + t), W 2^(-a_k - c_o),
dy 2^(c_o - t) for feature tile k, output tile o and token tile t. A rank that cut its tiles or
blocks anywhere else than the serial layer quantizes some tile with another scale (saturating it,
or rounding it coarser or to zero), and that tile's share of a sum, as large as any other's, is
off. Results are compared per 128 x 128 block of tokens and features, against the block's own
largest element. Each rank holds its CP chunk of the tokens (128 of
256 per sequence; under sequence parallelism its TP half of that) and its TP shard of the weights
(128 of 256 rows or columns). Column-parallel outputs contract whole rows on every rank: equal to
the serial layer's part exactly. Where partial sums are reduced (the column layer's input
gradient, the row layer's output, every weight gradient over CP) each partial is rounded once
more: within a few bf16 units of the largest element.
"""
from __future__ import annotations

import torch

from kernels.fp8 import Fp8Recipe
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from parallel.grads.weight_grad import WeightGradStore
from parallel.tensor_parallel import (ColumnParallelLinear, Initializer, RowParallelLinear,
                                      set_tp_comm_overlap)
from parallel.tensor_parallel.fp8 import set_fp8
from tests.helpers.dist_utils import run_distributed

RECIPE = Fp8Recipe("e4m3", "blockwise")
B, S, H = 2, 256, 256
BF16_ULP = 2.0 ** -8
PATHS = [  # (kind, sequence parallel, overlap ring, zero-bubble W split)
    ("column", False, False, False), ("column", True, False, False),
    ("column", True, True, False), ("column", True, True, True),
    ("row", False, False, False), ("row", True, False, False), ("row", True, True, True),
]


def _close(got, want, ulps, what):
    """Within ``ulps`` bf16 units of each 128 x 128 block's largest element (rows: tokens of a
    (b, s, h) tensor, 128 per sequence; columns: features)."""
    got, want = got.float().reshape(-1, got.shape[-1]), want.float().reshape(-1, want.shape[-1])
    for rows in torch.split(torch.arange(got.shape[0]), 128):
        for cols in torch.split(torch.arange(got.shape[1]), 128):
            g, w = got[rows][:, cols], want[rows][:, cols]
            err, top = (g - w).abs().max(), w.abs().max()
            assert err <= (ulps * BF16_ULP + 1e-6) * top, \
                f"{what}: block error {err.item():.3g} (largest |want| in it {top:.3g})"


def _operands():
    """(W, x, dy) with the inverse tile magnitudes of the module docstring."""
    g = torch.Generator().manual_seed(20)
    a, c, t = torch.tensor([-9.0, 9.0]), torch.tensor([8.0, -8.0]), torch.tensor([9.0, -9.0])
    along = lambda e: torch.exp2(e).repeat_interleave(128)                 # noqa: E731
    w = torch.randn(H, H, generator=g) * along(-c)[:, None] * along(-a)[None, :]
    x = torch.randn(B, S, H, generator=g) * along(a) * along(t)[:, None]
    dy = torch.randn(B, S, H, generator=g) * 1e-3 * along(c) * along(-t)[:, None]
    return w.bfloat16(), x.bfloat16(), dy.bfloat16()


def _layer(kind, state, sp, weight):
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(H, H, state, kind, Initializer(seed=1, std=0.02), bias=False,
                sequence_parallel=sp).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(state.tp_size, 0 if kind == "column" else 1)[state.tp_rank])
    set_fp8(layer, RECIPE)
    return layer


def _run(layer, x, g, store=None):
    x = x.detach().clone().requires_grad_()
    layer.weight_grad_store = store
    y = layer(x)
    if store is None:
        y.backward(g)
    else:
        with store.capture("k"):
            y.backward(g)
        store.run("k")
    return y.detach(), x.grad, layer.weight.grad


def _case(ps, kind, sp, ring, split):
    w, x, g = _operands()
    serial = _run(_layer(kind, ParallelState.serial(), False, w), x, g)
    layer = _layer(kind, ps, sp, w)
    if ring:
        set_tp_comm_overlap(layer, "ring")
    tp = ps.tp_size
    cut = lambda t: t.chunk(ps.cp_size, dim=1)[ps.cp_rank]                  # noqa: E731
    shard = lambda t: cut(t).chunk(tp, dim=1)[ps.tp_rank]                   # noqa: E731
    feat = lambda t: t.chunk(tp, dim=-1)[ps.tp_rank]                        # noqa: E731
    if kind == "column":
        x_in, g_in = (shard(x) if sp else cut(x)), feat(cut(g))
    else:
        x_in, g_in = feat(cut(x)), (shard(g) if sp else cut(g))
    y, dx, dw = _run(layer, x_in, g_in, WeightGradStore() if split else None)
    what = f"{kind} sp={sp} ring={ring} split={split}"
    if kind == "column":
        _close(y, feat(cut(serial[0])), 0, f"{what} output")
        _close(dx, shard(serial[1]) if sp else cut(serial[1]), 2, f"{what} input gradient")
    else:
        _close(y, shard(serial[0]) if sp else cut(serial[0]), 2, f"{what} output")
        _close(dx, feat(cut(serial[1])), 0, f"{what} input gradient")
    dw = dw.float()
    ps.cp_group.all_reduce(dw)        # what the DP x CP reduction does for these weights
    _close(dw, serial[2].float().chunk(tp, 0 if kind == "column" else 1)[ps.tp_rank], 2,
           f"{what} weight gradient")
    return what


def layouts(ps) -> list[str]:
    return [_case(ps, *path) for path in PATHS]


def test_every_path_equals_the_serial_blockwise_layer():
    results = run_distributed(layouts, grid=RankGrid(tp=2, cp=2))
    assert all(len(r) == len(PATHS) for r in results)
