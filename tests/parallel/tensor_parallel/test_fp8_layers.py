"""FP8 in the tensor-parallel layers (parallel/tensor_parallel/fp8.py): the serial layer against
torchao's Float8Linear and against the fp32 definition, then every path of both layers on a real
tp=2 x cp=2 gloo group against the serial FP8 layer.

- torchao 0.18's ``Float8Linear`` (recipes "tensorwise": e4m3 inputs and weights, e5m2 gradients,
  which is --fp8-format hybrid; "rowwise": e4m3 everywhere, power-of-two scales) is an
  independent implementation of the same three GEMMs: output, input gradient and weight gradient
  are equal bit for bit (same quantization, same torch._scaled_mm).
- The definition: each operand quantized and dequantized in fp32 with the scale of its whole
  tensor (or of each row along the contraction), multiplied in fp32. The layer's bf16 results may
  differ by the rounding of its bf16 output, one unit in the last place (2^-8 relative).
- Layouts: x, W and dy are logical tensors; each rank holds its CP chunk of the tokens (and under
  sequence parallelism its TP shard of that), its TP shard of the weights. Every scale a rank
  uses is the serial layer's, exactly (tensorwise scalars; rowwise vectors compared with the
  serial vectors' slice for the rank); outputs and gradients equal the serial layer's, exactly
  for the column-parallel GEMMs (whole contractions) and within bf16 rounding where partial sums
  are reduced. Each forward and each backward agrees its amaxes with one MAX all-reduce on the TP
  group and one on the CP group, counted as TP and CP traffic.
"""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import E4M3, Fp8Recipe
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import (ColumnParallelLinear, Initializer, RowParallelLinear,
                                      set_tp_comm_overlap)
from parallel.tensor_parallel import fp8 as fp8_module
from parallel.tensor_parallel.fp8 import set_fp8
from parallel.tensor_parallel.layers import column_parallel_linears
from parallel.grid.topology import RankGrid
from parallel.grads.weight_grad import WeightGradStore
from tests.helpers.dist_utils import record_comm, run_distributed

INIT = Initializer(seed=5, std=0.1)
RECIPES = [Fp8Recipe("hybrid", "tensorwise"), Fp8Recipe("e4m3", "tensorwise"),
           Fp8Recipe("hybrid", "rowwise"), Fp8Recipe("e4m3", "rowwise")]
B, S, IN, OUT = 2, 32, 64, 48
BF16_ULP = 2.0 ** -8


def _full(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def qdq(t: torch.Tensor, dtype, dim=None, pow2=False) -> torch.Tensor:
    """The definition: t quantized with the scale of its amax (over ``dim``, or all) and back."""
    top = torch.finfo(dtype).max
    a = t.float().abs().amax() if dim is None else t.float().abs().amax(dim=dim, keepdim=True)
    s = (top / a.double().clamp(min=1e-12)).float()
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return (t.float() * s).clamp(-top, top).to(dtype).float() / s


def reference(x, w, b, g, recipe: Fp8Recipe):
    """(y, dx, dW) of y = x W^T + b in fp32 from the quantized operands."""
    row, gd, p2 = recipe.rowwise, recipe.grad_dtype, recipe.power_of_two
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    y = qdq(x2, E4M3, -1 if row else None, p2) @ qdq(w, E4M3, -1 if row else None, p2).t()
    y = y + (0 if b is None else b.float())
    dx = qdq(g2, gd, -1 if row else None, p2) @ qdq(w, E4M3, 0 if row else None, p2)
    dw = qdq(g2, gd, 0 if row else None, p2).t() @ qdq(x2, E4M3, 0 if row else None, p2)
    return y.view(*x.shape[:-1], -1), dx.view(x.shape), dw


def _close(got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0, what: str = "") -> None:
    """Within ``ulps`` bf16 units of the largest element (a sum of rounded partial products can
    cancel, so the bound is norm-wise); ``ulps`` 0: equal up to fp32 reassociation (1e-6)."""
    err = (got.float() - want.float()).abs()
    top = want.float().abs().max()
    assert (err <= (ulps * BF16_ULP + 1e-6) * top).all(), \
        f"{what}: max error {err.max().item():.3g} (largest |want| {top:.3g})"


def _serial(kind: str, recipe: Fp8Recipe, bias: bool = True):
    ps = ParallelState.serial()
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(IN, OUT, ps, f"{kind}", INIT, bias=bias).to(torch.bfloat16)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(_full(9, OUT, scale=0.1))
    set_fp8(layer, recipe)
    return layer


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.format}-{r.recipe}")
def test_serial_layer_is_the_definition(kind, recipe):
    layer = _serial(kind, recipe)
    x, g = _full(1, B, S, IN, scale=2.0), _full(2, B, S, OUT, scale=1e-3)
    y, dx, dw, db = _run(layer, x, g)
    ry, rdx, rdw = reference(x, layer.weight.detach(), layer.bias.detach(), g, recipe)
    _close(y, ry)
    _close(dx, rdx)
    _close(dw, rdw)
    assert torch.equal(db, g.float().sum((0, 1)).to(torch.bfloat16))
    # not the bf16 layer: FP8's rounding is visible at this size
    plain = x.float() @ layer.weight.detach().float().t()
    assert (plain + layer.bias.detach().float() - ry).abs().max() > 50 * BF16_ULP * ry.abs().max() / 8


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.format}-{r.recipe}")
def test_a_deferred_weight_gradient_keeps_no_float8_copy(recipe):
    """Under a zero-bubble split W runs after B: between them nothing in float8 stays alive (the
    tensorwise dy copy that dgrad made for wgrad too was kept until W, 1 byte per element the
    docs and the planner do not count), and W's gradients equal the undeferred ones bit for bit."""
    import gc

    def float8_bytes() -> int:
        return sum(t.numel() * t.element_size() for t in gc.get_objects()    # (type(): no
                   if issubclass(type(t), torch.Tensor)                          # module's hooks)
                   and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    x, g = _full(1, B, S, IN, scale=2.0), _full(2, B, S, OUT, scale=1e-3)
    want = _run(_serial("column", recipe), x, g)
    layer = _serial("column", recipe)
    layer.weight_grad_store = store = WeightGradStore()
    xin = x.detach().clone().requires_grad_()
    y = layer(xin)
    gc.collect()
    before = float8_bytes()
    with store.capture("k"):
        y.backward(g)
    gc.collect()
    assert float8_bytes() == before and layer.weight.grad is None
    store.run("k")
    assert torch.equal(xin.grad, want[1])
    assert torch.equal(layer.weight.grad, want[2]) and torch.equal(layer.bias.grad, want[3])


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("ao_recipe,recipe", [("tensorwise", Fp8Recipe("hybrid", "tensorwise")),
                                              ("rowwise", Fp8Recipe("e4m3", "rowwise"))])
def test_serial_layer_equals_torchao(kind, ao_recipe, recipe):
    float8 = pytest.importorskip("torchao.float8")
    layer = _serial(kind, recipe, bias=False)
    ref = torch.nn.Sequential(torch.nn.Linear(IN, OUT, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        ref[0].weight.copy_(layer.weight)
    ref = float8.convert_to_float8_training(
        ref, config=float8.Float8LinearConfig.from_recipe_name(ao_recipe))
    assert type(ref[0]).__name__ == "Float8Linear"
    x, g = _full(3, B, S, IN, scale=2.0), _full(4, B, S, OUT, scale=1e-3)
    got, want = _run(layer, x, g), _run(ref[0], x, g)
    for a, b in zip(got[:3], want[:3]):
        if ao_recipe == "rowwise":
            assert torch.equal(a, b)
        else:   # the same quantized operands and scales; on the CPU torchao's one-scale GEMM is
            # oneDNN's reference kernel, ours the per-row kernel (kernels/fp8.py): the fp32 sums
            # round to bf16 alike but for an element's last bit (one unit of its own magnitude)
            torch.testing.assert_close(a.float(), b.float(), rtol=2.0 ** -7, atol=0)
            assert (a != b).float().mean() < 0.01, "more than a stray rounding apart"


# ---- layouts: tp=2 x cp=2 ---------------------------------------------------------------------

PATHS = [  # (kind, sequence parallel, overlap ring, zero-bubble W split, two weights on one input)
    ("column", False, False, False, False), ("column", True, False, False, False),
    ("column", True, True, False, False), ("column", True, True, True, False),
    ("column", True, False, True, True), ("column", False, False, True, True),
    ("row", False, False, False, False), ("row", True, False, False, False),
    ("row", True, True, False, False), ("row", True, True, True, False),
]


def _recorder(store: list):
    """Wrap Fp8Forward / Fp8Backward so each records itself (observes; the scales are theirs)."""
    fwd_init, bwd_init = fp8_module.Fp8Forward.__init__, fp8_module.Fp8Backward.__init__

    def fwd(self, *a, **k):
        fwd_init(self, *a, **k)
        store.append(("forward", self))

    def bwd(self, *a, **k):
        bwd_init(self, *a, **k)
        store.append(("backward", self))
    fp8_module.Fp8Forward.__init__, fp8_module.Fp8Backward.__init__ = fwd, bwd
    return lambda: (setattr(fp8_module.Fp8Forward, "__init__", fwd_init),
                    setattr(fp8_module.Fp8Backward, "__init__", bwd_init))


def _scales(record, names: dict) -> dict:
    """Every scale each call used, by (pass, weight name): x's and W's in forward; dy's per-token
    and per-feature, W's per-column and x's per-column in backward (tensorwise: 0-d, repeated)."""
    out = {}
    for what, obj in record:
        fwd = obj if what == "forward" else obj.fwd
        for i, w in enumerate(fwd.weights):
            name = names[id(w)]
            if what == "forward":
                out[(what, name)] = [obj.x_scale, obj.w_scales[i]]
            elif i in obj.g_cols:
                out[(what, name)] = [obj.g_rows.get(i), obj.g_cols[i], obj.w_cols[i], obj.x_cols]
    return out


def expected_reductions(recipe: Fp8Recipe, kind: str, ring: bool) -> list:
    """The groups of one layer call's MAX all-reduces, forward then backward (parallel/
    tensor_parallel/fp8.py): an amax is reduced over the groups that shard the axes it runs over.
    Column: x's tokens split over CP (and TP under sequence parallelism), W's rows and dy's
    features over TP; rowwise, its forward scales are whole rows here and need nothing. Row: x's
    and W's features over TP; dy is whole on each TP rank (only CP splits its tokens) unless the
    ring hands the layer its sequence shard."""
    if kind == "column":
        return ([] if recipe.rowwise else ["tp", "cp"]) + ["tp", "cp"]
    return (["tp"] if recipe.rowwise else ["tp", "cp"]) + (["tp", "cp"] if ring else ["cp"])


def _mine(serial: torch.Tensor | None, local: torch.Tensor | None, ps) -> torch.Tensor | None:
    """The part of a serial scale this rank holds: a token dim (1 of a 3-D tensor) split over CP,
    a feature dim (0 of 1-D / 2-D) over TP; a gathered rank's per-token scales (None) are not."""
    if local is None or serial is None:
        return local if serial is None else None
    out = serial
    if out.dim() == 3 and out.shape[1] != local.shape[1]:
        out = out.chunk(ps.cp_size, dim=1)[ps.cp_rank]
    if out.dim() in (1, 2) and out.shape[0] != local.shape[0]:
        out = out.chunk(ps.tp_size, dim=0)[ps.tp_rank]
    return out


def _layout_case(ps, recipe, kind, sp, ring, split, pair, results):
    names = ("gate", "up") if pair else (kind,)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    in_f, out_f = (IN, OUT) if kind == "column" else (OUT, IN)
    x, g = _full(11, B, S, in_f, scale=2.0), [_full(12 + i, B, S, out_f, scale=1e-3) for i in range(len(names))]

    def build(state, seq):
        mods = [cls(in_f, out_f, state, n, INIT, bias=True, sequence_parallel=seq).to(torch.bfloat16)
                for n in names]
        for i, m in enumerate(mods):
            with torch.no_grad():
                m.bias.copy_(_full(30 + i, out_f, scale=0.1).chunk(
                    state.tp_size if kind == "column" else 1)[state.tp_rank if kind == "column" else 0])
        set_fp8(torch.nn.ModuleList(mods), recipe)
        return mods

    def run(mods, xin, gs, store=None):
        xin = xin.detach().clone().requires_grad_()
        for m in mods:
            m.weight_grad_store = store
        outs = (column_parallel_linears(mods, xin) if kind == "column" else [mods[0](xin)])
        if store is not None:
            with store.capture("k"):
                torch.autograd.backward(outs, gs)
            store.run("k")
        else:
            torch.autograd.backward(outs, gs)
        return [o.detach() for o in outs], xin.grad, [m.weight.grad for m in mods], [m.bias.grad for m in mods]

    case = f"{recipe.describe()} {kind} sp={sp} ring={ring} split={split} pair={pair}"
    record: list = []
    undo = _recorder(record)
    try:
        smods = build(ParallelState.serial(), False)
        serial = run(smods, x, g)
        n_serial = len(record)
        mods = build(ps, sp)
        if ring:
            set_tp_comm_overlap(torch.nn.ModuleList(mods), "ring")
        tp, cp = ps.tp_size, ps.cp_size
        cut = lambda t: t.chunk(cp, dim=1)[ps.cp_rank]                       # noqa: E731
        shard = lambda t: cut(t).chunk(tp, dim=1)[ps.tp_rank]                 # noqa: E731
        x_in = shard(x) if (sp and kind == "column") else cut(x)
        if kind == "column":
            x_in = x_in if sp else cut(x)
            g_in = [cut(t).chunk(tp, dim=-1)[ps.tp_rank] for t in g]
        else:
            x_in = cut(x).chunk(tp, dim=-1)[ps.tp_rank]
            g_in = [shard(t) if sp else cut(t) for t in g]
        before = ps.comm.snapshot()
        with record_comm(ps) as events:
            local = run(mods, x_in, g_in, WeightGradStore() if split else None)
        counted = ps.comm.since(before)
    finally:
        undo()
    # scales: the serial layer's (its part for this rank), exactly
    serial_scales = _scales(record[:n_serial], {id(m.weight): n for m, n in zip(smods, names)})
    local_scales = _scales(record[n_serial:], {id(m.weight): n for m, n in zip(mods, names)})
    assert serial_scales.keys() == local_scales.keys() and len(local_scales) == 2 * len(names)
    for key, got_list in local_scales.items():
        for want, got in zip(serial_scales[key], got_list):
            want = _mine(want, got, ps)
            assert (want is None) == (got is None), (key, got, want)
            assert got is None or torch.equal(got, want), (key, got, want)
    # one MAX all-reduce of fp32 amaxes per group and pass of each call, nothing else in fp32
    calls = 2 if pair and not sp else 1
    reductions = [e.group for e in events if e.op == "all_reduce" and e.dtype == "float32"]
    want_red = expected_reductions(recipe, kind, ring)
    assert sorted(reductions) == sorted(want_red * calls), (reductions, want_red)
    if calls == 1:   # and in this order: TP before CP in each pass
        assert reductions == want_red, (reductions, want_red)
    # counted as TP traffic (tp_comm_bytes): the counters saw every TP event's payload
    assert counted["tp"]["payload_bytes"] == sum(e.payload_bytes for e in events if e.group == "tp")
    # outputs and gradients: the serial layer's part
    # partial sums reduced in bf16: each partial rounded, the sum rounded, the serial result
    # rounded once: two units of the largest element at most. A column shard computes the same
    # products, but the CPU GEMM may sum them in another order for another output width (AMX
    # and AVX-512 kernels choose their blocking by shape): one bf16 rounding apart at most
    ulps = 1 if kind == "column" else 2
    for i in range(len(names)):
        want_y = cut(serial[0][i])
        want_y = want_y.chunk(tp, -1)[ps.tp_rank] if kind == "column" else (
            want_y.chunk(tp, 1)[ps.tp_rank] if sp else want_y)
        _close(local[0][i], want_y, ulps, f"{case} output")
    want_dx = shard(serial[1]) if (sp and kind == "column") else cut(serial[1])
    want_dx = want_dx if kind == "column" else want_dx.chunk(tp, -1)[ps.tp_rank]
    _close(local[1], want_dx, 0 if kind == "row" else 1 + len(names), f"{case} input gradient")
    for i in range(len(names)):
        dw = local[2][i].float()
        ps.cp_group.all_reduce(dw)   # what the DP x CP reduction does for these weights
        want_dw = serial[2][i].float().chunk(tp, 0 if kind == "column" else 1)[ps.tp_rank]
        _close(dw, want_dw, 2, f"{case} weight gradient")
    results.append((recipe.describe(), kind, sp, ring, split, pair))


def layouts(ps) -> list:
    torch.manual_seed(0)
    results: list = []
    for recipe in RECIPES:
        for kind, sp, ring, split, pair in PATHS:
            _layout_case(ps, recipe, kind, sp, ring, split, pair, results)
    return results


def test_every_path_of_every_layout_uses_the_serial_scales():
    results = run_distributed(layouts, grid=RankGrid(tp=2, cp=2))
    assert all(len(r) == len(RECIPES) * len(PATHS) for r in results)
