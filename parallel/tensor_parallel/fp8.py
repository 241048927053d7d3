"""FP8 GEMMs of the tensor-parallel layers, with every scale taken over the logical tensor.

A layer call's three GEMMs (forward ``y = x W^T``, input gradient ``dx = dy W``, weight gradient
``dW = dy^T x``) run on float8 operands through ``kernels.fp8.scaled_mm``, in the layers' own
autograd Functions (split_linear.py, overlap.py), on the same pieces of the same tensors as their
bf16 GEMMs. What FP8 adds is the scales, and those must not depend on the layout: a rank holds a
shard of x, W or dy (TP splits features and weights, sequence parallelism and context parallelism
split tokens), so the largest magnitude behind a scale is reduced over the groups that shard the
axis it runs over (``Operand``), with a MAX all-reduce through the engine's ``CommGroup`` (checked
against the backend rules, counted in ``tp_comm_bytes`` / ``cp_comm_bytes``). Every layout then
quantizes each element of the serial run's tensors with the serial run's scale.

Per layer call there is one all-reduce per group for all its amaxes (``kernels.fp8.Amaxes``): in
forward those of x and of every weight, in backward those of the output gradients (and, rowwise, the weights'
and x's column scales), TP first, then CP. Scales by recipe (``kernels.fp8.Fp8Recipe``), for an
operand of rows and columns:

- tensorwise: one scale per tensor, reduced over every group that shards it; the same scale
  serves a tensor in both GEMMs it enters;
- rowwise: one scale per row of each GEMM operand along its contraction dimension: x per token
  over features (forward) and per feature over tokens (weight gradient), W per output row
  (forward) and per input column (input gradient), dy per token (input gradient) and per output
  feature (weight gradient). A per-token scale is reduced over the groups sharding the features;
  a per-feature scale over those sharding the tokens. Tokens gathered before the GEMM (sequence
  parallelism: ``Operand.gathered``) have whole rows in every chunk the GEMM sees, so their
  per-token scales are computed there, from the rows themselves, with no communication.
- blockwise (kernels/fp8_blockwise.py): one scale per 1 x 128 tile of x and dy along each GEMM's
  contraction dimension (tokens cut per sequence), one per 128 x 128 block of W. Every tile is
  whole on one rank where each sharded dimension is a multiple of 128 per rank (the configuration
  refuses the rest), so the scales are the serial run's with no communication at all.

Nothing FP8 is kept between forward and backward but the scales: backward quantizes again from the
saved bf16 tensors (what torchao's float8 linear saves), so the activation memory is the bf16
run's; the float8 copies are transients of each GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import fp8_blockwise as blockwise
from kernels.fp8 import Amaxes, Fp8Recipe, amax, amax_to_scale, quantize, scaled_mm
from parallel.tensor_parallel.ring import chunk_of

@dataclass(frozen=True, eq=False)
class Operand:
    """Where the pieces of a GEMM operand live: the groups that shard its rows (tokens; a
    weight's output rows) and its columns (features; a weight's input columns) as the layer holds
    it, and ``gathered``: the group over which the held rows (a sequence shard) are gathered
    before the GEMM."""
    rows: tuple = ()
    cols: tuple = ()
    gathered: object = None

    @property
    def row_groups(self) -> tuple:
        """Everything that shards the rows (what a per-column scale is reduced over)."""
        return self.rows + ((self.gathered,) if self.gathered is not None else ())

    @property
    def all_groups(self) -> tuple:
        return self.row_groups + self.cols


@dataclass(frozen=True, eq=False)
class Fp8Spec:
    """One layer path's FP8 recipe and where its input x, weights W and output gradients dy live."""
    recipe: Fp8Recipe
    x: Operand
    w: Operand
    g: Operand


def column_spec(recipe: Fp8Recipe, tp, cp, sequence_shard: bool) -> Fp8Spec:
    """Column-parallel: x (b, s, in) replicated over TP (or its sequence shard, gathered), W
    (out/tp, in), dy (b, s, out/tp); tokens split over CP."""
    return Fp8Spec(recipe, Operand(rows=(cp,), gathered=tp if sequence_shard else None),
                   Operand(rows=(tp,)), Operand(rows=(cp,), cols=(tp,)))


def row_spec(recipe: Fp8Recipe, tp, cp, grad_shard: bool) -> Fp8Spec:
    """Row-parallel: x (b, s, in/tp), W (out, in/tp), dy (b, s, out) replicated over TP (or, in
    the overlapped ring, its sequence shard, gathered); tokens split over CP."""
    return Fp8Spec(recipe, Operand(rows=(cp,), cols=(tp,)), Operand(cols=(tp,)),
                   Operand(rows=(cp,), gathered=tp if grad_shard else None))


def _col_amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| over every row, per column: (..., k) -> (k,)."""
    return amax(t.reshape(-1, t.shape[-1]), dim=0).reshape(-1)


def _slice(scale: torch.Tensor, chunk) -> torch.Tensor:
    """A per-token scale (b, s, 1) cut to the sequence chunk (c, n) a GEMM sees."""
    return scale if chunk is None or scale.dim() == 0 else chunk_of(scale, *chunk)


def _inv(scale: torch.Tensor, shape) -> torch.Tensor:
    """The dequantization scale torch._scaled_mm takes: 0-d, or reshaped to (M, 1) / (1, N)."""
    inv = scale.reciprocal()
    return inv if inv.dim() == 0 else inv.reshape(shape).contiguous()


class Fp8Forward:
    """The scales of one forward call: x's and each weight's, agreed over the groups (one
    reduction per group). ``linear`` runs a forward GEMM on x or a sequence chunk of it."""

    def __init__(self, spec: Fp8Spec, x_held: torch.Tensor, weights):
        self.spec, self.weights = spec, list(weights)
        r = spec.recipe
        if r.blockwise:   # each tile's own scale: nothing to agree over a group
            self.x_scale, self.w_scales = None, [blockwise.block_scales(w) for w in self.weights]
            return
        am = Amaxes()
        if not r.rowwise:
            ix = am.add(amax(x_held), spec.x.all_groups)
            iw = [am.add(amax(w), spec.w.all_groups) for w in self.weights]
        else:   # x per token over features (here unless its rows are gathered), W per output row
            ix = None if spec.x.gathered is not None else am.add(amax(x_held, -1), spec.x.cols)
            iw = [am.add(amax(w, -1), spec.w.cols) for w in self.weights]
        values = am.reduce()
        dtype, pow2 = r.forward_dtype, r.power_of_two
        self.x_scale = None if ix is None else amax_to_scale(values[ix], dtype, pow2)
        self.w_scales = [amax_to_scale(values[i], dtype, pow2) for i in iw]

    def x_scale_for(self, x: torch.Tensor, chunk=None) -> torch.Tensor:
        if self.x_scale is None:   # whole rows here: the per-token scales of these rows
            r = self.spec.recipe
            return amax_to_scale(amax(x, -1), r.forward_dtype, r.power_of_two)
        return _slice(self.x_scale, chunk)

    def linear(self, x: torch.Tensor, i: int, bias=None, chunk=None) -> torch.Tensor:
        """(b, s', in) -> (b, s', out): x W_i^T (+ b) from float8 operands; ``chunk`` (c, n):
        x is sequence chunk c of n of the tensor the scales were taken for."""
        w, k = self.weights[i], x.shape[-1]
        if self.spec.recipe.blockwise:   # the tiles of the rows this GEMM sees
            return blockwise.linear(x, w, self.w_scales[i], bias)
        dtype = self.spec.recipe.forward_dtype
        s_x, s_w = self.x_scale_for(x, chunk), self.w_scales[i]
        a = quantize(x, s_x, dtype).reshape(-1, k)                 # (M, in) row-major
        b = quantize(w, s_w, dtype).t()                            # (in, out) column-major
        out = scaled_mm(a, b, _inv(s_x, (-1, 1)), _inv(s_w, (1, -1)), x.dtype, bias,
                        fast_accum=True)                   # the forward GEMM (torchao's choice)
        return out.view(*x.shape[:-1], w.shape[0])


class Fp8Backward:
    """The scales of one backward call (the output gradients', and rowwise the weights' and x's
    column scales), agreed over the groups; ``dgrad`` and ``wgrad`` run the two GEMMs.
    ``x_held``: the saved input as the layer holds it (a shard under sequence parallelism), None
    when no weight gradient is computed from it."""

    def __init__(self, fwd: Fp8Forward, grads, x_held: torch.Tensor | None):
        self.fwd, self.spec, self.grads = fwd, fwd.spec, list(grads)
        r = self.spec.recipe
        if r.blockwise:   # tiles of the gradients the GEMMs see: no scale kept, no reduction
            return
        gd, fd, pow2 = r.grad_dtype, r.forward_dtype, r.power_of_two
        live = [i for i, g in enumerate(self.grads) if g is not None]
        am = Amaxes()
        self._gq: dict = {}
        if not r.rowwise:
            ig = {i: am.add(amax(self.grads[i]), self.spec.g.all_groups) for i in live}
            values = am.reduce()
            self.g_rows = self.g_cols = {i: amax_to_scale(values[ig[i]], gd) for i in live}
            self.w_cols, self.x_cols = dict(enumerate(fwd.w_scales)), fwd.x_scale
            return
        g, w, x = self.spec.g, self.spec.w, self.spec.x
        ir = {i: am.add(amax(self.grads[i], -1), g.cols) for i in live} if g.gathered is None else {}
        ic = {i: am.add(_col_amax(self.grads[i]), g.row_groups) for i in live}
        iw = {i: am.add(_col_amax(fwd.weights[i]), w.row_groups) for i in live}
        ix = am.add(_col_amax(x_held), x.row_groups) if x_held is not None else None
        values = am.reduce()
        self.g_rows = {i: amax_to_scale(values[j], gd, pow2) for i, j in ir.items()}
        self.g_cols = {i: amax_to_scale(values[j], gd, pow2) for i, j in ic.items()}
        self.w_cols = {i: amax_to_scale(values[j], fd, pow2) for i, j in iw.items()}
        self.x_cols = None if ix is None else amax_to_scale(values[ix], fd, pow2)

    def _g_row_scale(self, i: int, g: torch.Tensor, chunk) -> torch.Tensor:
        if i in self.g_rows:
            return _slice(self.g_rows[i], chunk)
        r = self.spec.recipe   # rowwise, gathered rows: the scales of the rows the GEMM sees
        return amax_to_scale(amax(g, -1), r.grad_dtype, r.power_of_two)

    def _quantized_grad(self, i: int, g: torch.Tensor, scale: torch.Tensor, whole: bool):
        """dy_i in float8; tensorwise, the whole tensor's copy serves both GEMMs."""
        if not whole or self.spec.recipe.rowwise:
            return quantize(g, scale, self.spec.recipe.grad_dtype)
        if i not in self._gq:
            self._gq[i] = quantize(g, scale, self.spec.recipe.grad_dtype)
        return self._gq[i]

    def defer_wgrad(self) -> None:
        """The weight gradients run later (a zero-bubble W): the float8 copy of dy that dgrad
        made for wgrad too (tensorwise) is dropped; W quantizes dy again with the same scale
        (the same bytes), so only the dy W needs anyway waits for it, as the docs and the
        planner count."""
        self._gq = {}

    def dgrad(self, g: torch.Tensor, i: int, chunk=None) -> torch.Tensor:
        """(b, s', out) -> (b, s', in): dy W_i; ``chunk`` as in ``Fp8Forward.linear``."""
        w, o = self.fwd.weights[i], g.shape[-1]
        if self.spec.recipe.blockwise:
            return blockwise.dgrad(g, w, self.fwd.w_scales[i])
        s_g, s_w = self._g_row_scale(i, g, chunk), self.w_cols[i]
        a = self._quantized_grad(i, g, s_g, chunk is None).reshape(-1, o)       # (M, out)
        b = quantize(w, s_w, self.spec.recipe.forward_dtype).t().contiguous().t()  # (out, in) col-major
        out = scaled_mm(a, b, _inv(s_g, (-1, 1)), _inv(s_w, (1, -1)), g.dtype)
        return out.view(*g.shape[:-1], w.shape[1])

    def wgrad(self, g: torch.Tensor, x: torch.Tensor, i: int) -> torch.Tensor:
        """dy_i^T x: (b, s, out) and (b, s, in), the whole tokens of this rank -> (out, in)."""
        w, o, k = self.fwd.weights[i], g.shape[-1], x.shape[-1]
        if self.spec.recipe.blockwise:
            return blockwise.wgrad(g, x, w.dtype)
        s_g, s_x = self.g_cols[i], self.x_cols
        a = self._quantized_grad(i, g, s_g, True).reshape(-1, o).t().contiguous()    # (out, M)
        b = quantize(x, s_x, self.spec.recipe.forward_dtype).reshape(-1, k)        # (M, in)
        b = b.t().contiguous().t()                                                 # column-major
        return scaled_mm(a, b, _inv(s_g, (-1, 1)), _inv(s_x, (1, -1)), w.dtype)


def set_fp8(modules, recipe: Fp8Recipe | None) -> int:
    """Run every TP linear and every MoE layer's experts (models/moe/experts.py: their grouped
    GEMMs, kernels/fp8_grouped.py) of ``modules`` in FP8 with ``recipe`` (None: bf16 again);
    returns how many modules. Embedding, output layer, norms, attention and routers have no FP8
    path."""
    count = 0
    for module in (modules if isinstance(modules, (list, tuple)) else [modules]):
        for m in module.modules():
            if hasattr(m, "fp8_spec"):
                m.fp8 = recipe
                count += 1
    return count
