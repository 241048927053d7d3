"""The experts' projections with the weight gradients split off (the W of a zero-bubble schedule,
parallel/grads/weight_grad.py): ``_GroupedLinearDeferW``, the grouped counterpart of
``_LinearDeferW`` (parallel/tensor_parallel/split_linear.py), used by ``LocalExperts`` when a
``WeightGradStore`` is attached to its experts.

One projection (fc1, gate-up or fc2) over the local experts: row group g of x (rows up to
``offsets[g]``, sorted by expert) times expert g's block of the stacked weight (G, out, in), plus
its bias.

- forward: y = x_g W_g^T + b_g per group by ``kernels.grouped_linear`` (the same device paths as
  without a store: ``torch._grouped_mm``, ``npu_grouped_matmul`` or the loop,
  kernels/grouped_gemm.py); x and the offsets are kept.
- B: dx_g = dy_g W_g per group, ``kernels.grouped_input_grad`` on the same stacked weight.
- W: one closure per projection: dW = every group's dy_g^T x_g as ONE grouped GEMM
  (``kernels.grouped_weight_grad``, (G, out, in)) added to the stacked weight's gradient in one
  ``accumulate``, and db_g = sum dy_g per group (one ``index_add`` over the rows' groups). An
  expert without rows gets a zero block, as a GEMM over no rows gives.

In FP8 (``fp8``, the projection's ``kernels.GroupedFp8Spec``) the three GEMMs take float8
operands (kernels/fp8_grouped.py): the forward by ``Fp8GroupedForward``; in B ``Fp8GroupedBackward``
agrees on every backward scale (its amax reductions run there, in the same order on every rank) and
runs the input gradient; the W closure runs its weight gradient with those scales, per row segment
(``segments``: the weight gradient's column scales per source, None: per group).

The Parameters are passed in and kept on ``ctx`` as the Parameter objects (only x goes through
``save_for_backward``): under activation checkpointing a saved tensor comes back as a recomputed
alias, and W must accumulate into the Parameter itself. Without a capturing store the same
Function returns the weight gradients to autograd, as ``_LinearDeferW`` does.
"""
from __future__ import annotations

import torch

import kernels
from kernels.fp8_grouped import Fp8GroupedBackward, Fp8GroupedForward, GroupedFp8Spec
from kernels.grouped_gemm import add_group_bias, group_sum, row_groups
from parallel.grads.weight_grad import WeightGradStore, accumulate, apply_split


def _weight_grads(weight, bias, grad, x, offsets, paths, fp8: Fp8GroupedBackward | None = None):
    """(dW (G, out, in), db (G, out) or None) of one projection; ``fp8``: its FP8 backward."""
    dw = kernels.grouped_weight_grad(grad, x, offsets, paths) if fp8 is None else fp8.wgrad()
    db = None
    if bias is not None:
        db = group_sum(grad, row_groups(offsets, grad.shape[0]), bias.shape[0]).to(bias.dtype)
    return dw, db


def _accumulate_all(weight, bias, grad, x, offsets, paths, fp8=None) -> None:
    dw, db = _weight_grads(weight, bias, grad, x, offsets, paths, fp8)
    accumulate(weight, dw)
    if bias is not None:
        accumulate(bias, db)


class _GroupedLinearDeferW(torch.autograd.Function):
    """y_g = x_g W_g^T + b_g per row group, the weight gradients in W when a store is capturing
    (module docstring)."""

    @staticmethod
    def forward(ctx, x, offsets, store, paths, fp8, segments, weight, bias):
        # x (n, in), weight (G, out, in), segments (S,) or None
        ctx.save_for_backward(x)
        # the parameters themselves, not saved tensors (module docstring)
        ctx.offsets, ctx.store, ctx.paths, ctx.weight, ctx.bias = offsets, store, paths, weight, bias
        ctx.fp8, ctx.segments = fp8, offsets if segments is None else segments
        if fp8 is None:
            return kernels.grouped_linear(x, weight, offsets, bias, paths)  # (n, out)
        y = Fp8GroupedForward(fp8, x, weight).linear(x, weight, offsets)   # (n, out)
        return add_group_bias(y, bias, offsets)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        (x,) = ctx.saved_tensors
        weight, bias, offsets, paths = ctx.weight, ctx.bias, ctx.offsets, ctx.paths
        grad = grad.contiguous()
        fp8 = None   # in FP8 every backward scale is agreed here, in B
        if ctx.fp8 is not None:
            fp8 = Fp8GroupedBackward(ctx.fp8, grad, x, weight.detach(), offsets, ctx.segments)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (kernels.grouped_input_grad(grad, weight.detach(), offsets, paths)
                      if fp8 is None else fp8.dgrad())                       # (n, in)
        head = (grad_x,) + (None,) * 5
        params = (weight,) if bias is None else (weight, bias)
        if ctx.store is not None and ctx.store.defer(
                lambda: _accumulate_all(weight, bias, grad, x, offsets, paths, fp8), params, (grad, x)):
            return head + (None, None)
        if not any(ctx.needs_input_grad[6:]):
            return head + (None, None)
        dw, db = _weight_grads(weight, bias, grad, x, offsets, paths, fp8)
        return head + (dw.to(weight.dtype), None if db is None else db.to(bias.dtype))


def grouped_linear_defer_w(x: torch.Tensor, weight: torch.Tensor, bias, offsets: torch.Tensor,
                           store: WeightGradStore | None, paths=None,
                           fp8: GroupedFp8Spec | None = None,
                           segments: torch.Tensor | None = None) -> torch.Tensor:
    """Row group g of x (rows up to ``offsets[g]``) times ``weight[g]`` (out, in) plus ``bias[g]``
    (or no bias): (n, in) -> (n, out), dW and db left to W while ``store`` captures; ``fp8``: the
    three GEMMs in float8, the weight gradient per row segment (``segments``, None: per group)."""
    return apply_split(_GroupedLinearDeferW, store, x, offsets, store, paths, fp8, segments, weight,
                       bias)
