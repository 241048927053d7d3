"""The experts' whole MLP over rows sorted by group: two grouped GEMMs around an activation, as one
autograd.Function where ``torch._grouped_mm`` runs both projections.

``grouped_mlp(x, offsets, w_in, w_out, kind, b_in=None, b_out=None, groups=None, paths=None)``:
x (n, h) holding group g's rows at [offsets[g-1], offsets[g]) (``offsets`` (G,) the cumulative row
counts on x's device, as ``grouped_linear`` takes them), w_in (G, f_in, h) with f_in = f for
``kind`` "gelu" (tanh approximation) and 2 f = [gate | up] for "swiglu", w_out (G, h_out, f),
biases (G, f_in) and (G, h_out) or None -> (n, h_out), row r of group g being

    act(x[r] @ w_in[g].T + b_in[g]) @ w_out[g].T + b_out[g]

- Where ``grouped_linear`` takes ``torch._grouped_mm`` for both projections (kernels/
  grouped_gemm.py: CUDA bf16, the CPU's fp32 and bf16, aligned rows; both weights' base pointers
  on 16 bytes, checked on every device by ``weights_aligned``; the biases in x's dtype):
  ``_GroupedMlpForwardGroupedMlpBackward``, its backward written out: grad @ w_out and grad.T @ a
  per group (a group without rows: a zero block, set on the device, ``_gmm_wgrad``), the
  activation's derivative (aten's ``gelu_backward``, or
  ``kernels.swiglu_packed_backward``, compiled on CUDA), dh @ w_in and dh.T @ x per group, each
  bias's gradient ``group_sum`` (the rows added in fp32, rounded once, where a bf16
  ``index_add_`` rounds every add on CUDA). The kernels of the composition below, without
  its per-node bookkeeping and the two projections' own Functions:
  that bookkeeping is host time a device waits behind (benchmarks/host/moe_layer.py). It saves x, the
  pre-activation h and the activation a (what autograd saves for the composition) and the
  parameters themselves (no stacked copy).
- Elsewhere (the NPU's ``npu_grouped_matmul``, the loop): the composition ``grouped_linear``,
  the activation (``F.gelu``, ``kernels.swiglu_packed``), ``grouped_linear``, under autograd.
- In FP8 (``fp8``: the two projections' ``GroupedFp8Spec``, kernels/fp8_grouped.py): the same
  composition with ``fp8_grouped_linear`` for each projection (``torch._scaled_grouped_mm`` or a
  ``torch._scaled_mm`` per group), the activation in bf16 between; ``segments``: the weight
  gradients' row segments (None: the groups).

``grouped_mlp_reference(x, counts, ...)``: the loop (``grouped_linear_reference`` per projection,
the plain activation), the reference both are tested against (tests/kernels/test_grouped_mlp.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import KernelPaths
from kernels.fp8_grouped import fp8_grouped_linear
from kernels.grouped_gemm import (ALIGN_BYTES, _gmm, _gmm_wgrad, _widths_aligned, group_sum,
                                  grouped_linear, grouped_linear_path, grouped_linear_reference,
                                  row_groups)
from kernels.swiglu import swiglu_packed, swiglu_packed_backward

KINDS = ("gelu", "swiglu")


def _act(h: torch.Tensor, kind: str, paths: KernelPaths | None) -> torch.Tensor:
    return F.gelu(h, approximate="tanh") if kind == "gelu" else swiglu_packed(h, paths)


def _act_backward(grad: torch.Tensor, h: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return torch.ops.aten.gelu_backward(grad, h, approximate="tanh")
    return swiglu_packed_backward(grad, h)


class _GroupedMlpForwardGroupedMlpBackward(torch.autograd.Function):
    """act(x_g W_in[g]^T + b_in[g]) W_out[g]^T + b_out[g] per row group by torch._grouped_mm;
    backward four grouped GEMMs, the activation's derivative and one group_sum per bias."""

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, offs, groups, kind: str, paths):
        # x (n, h), w_in (G, f_in, h), w_out (G, h_out, f), offs (G,) int32, groups (n,) or None
        h = _gmm(x, w_in.transpose(1, 2), offs)                        # (n, f_in)
        if b_in is not None:
            h += b_in.index_select(0, groups)
        a = _act(h, kind, paths)                                        # (n, f)
        y = _gmm(a, w_out.transpose(1, 2), offs)                       # (n, h_out)
        if b_out is not None:
            y += b_out.index_select(0, groups)
        ctx.save_for_backward(x, h, a, w_in, w_out, offs, groups)
        ctx.kind = kind
        return y

    @staticmethod
    def backward(ctx, grad):  # (n, h_out)
        x, h, a, w_in, w_out, offs, groups = ctx.saved_tensors
        need_x, need_w_in, need_b_in, need_w_out, need_b_out = ctx.needs_input_grad[:5]
        grad = grad.contiguous()
        g = w_out.shape[0]
        db_out = group_sum(grad, groups, g) if need_b_out else None
        dw_out = _gmm_wgrad(grad.t(), a, offs) if need_w_out else None      # (G, h_out, f)
        dh = _act_backward(_gmm(grad, w_out, offs), h, ctx.kind)            # (n, f_in)
        db_in = group_sum(dh, groups, g) if need_b_in else None
        dw_in = _gmm_wgrad(dh.t(), x, offs) if need_w_in else None          # (G, f_in, h)
        dx = _gmm(dh, w_in, offs) if need_x else None                       # (n, h)
        return dx, dw_in, db_in, dw_out, db_out, None, None, None, None


def weights_aligned(w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether both stacked weights meet torch._grouped_mm's rule on any device: contiguous,
    their widths times the element size multiples of 16 bytes, and their base pointers on 16
    bytes (CUDA's kernel requires it, the CPU's does not; a weight that is a view at an offset
    into a larger buffer may miss it). Inside a compiled graph the pointers are not known (and
    the buffers are aligned), so the widths decide."""
    for w in (w_in, w_out):
        if not (w.is_contiguous() and _widths_aligned(w.element_size(), *w.shape[1:])):
            return False
        if not torch.compiler.is_compiling() and w.data_ptr() % ALIGN_BYTES:
            return False
    return True


def fused_path(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, biases=(),
               paths: KernelPaths | None = None) -> bool:
    """Whether ``grouped_mlp`` runs as one Function: torch._grouped_mm takes both projections
    (the intermediate activation is a fresh contiguous tensor, so x's own layout and the weights'
    widths and base pointers decide the second: ``weights_aligned``), and the biases are in x's
    dtype."""
    return (x.shape[0] > 0 and grouped_linear_path(x, w_in, paths) == "torch"
            and w_out.dtype == x.dtype and weights_aligned(w_in, w_out)
            and all(b is None or b.dtype == x.dtype for b in biases))


def _check(x, w_in, w_out, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"grouped_mlp: kind must be one of {KINDS}, got {kind!r}")
    f = w_in.shape[1] // (2 if kind == "swiglu" else 1)
    if w_out.dim() != 3 or w_out.shape[0] != w_in.shape[0] or w_out.shape[2] != f:
        raise ValueError(f"grouped_mlp: w_out must be (G, out, f) = ({w_in.shape[0]}, out, {f}) "
                         f"for w_in {tuple(w_in.shape)} and {kind}, got {tuple(w_out.shape)}")


def grouped_mlp(x: torch.Tensor, offsets: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                kind: str, b_in: torch.Tensor | None = None, b_out: torch.Tensor | None = None,
                groups: torch.Tensor | None = None, paths: KernelPaths | None = None,
                fp8: tuple | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' MLP on rows sorted by group: (n, h) -> (n, h_out) (module docstring).
    ``groups`` (n,): each row's group when the caller has it (for the biases; computed from the
    offsets otherwise); ``paths``: the chip's fused ops (None: all); ``fp8``: (w_in's, w_out's)
    ``GroupedFp8Spec`` to run both projections in FP8, with the weight gradients' ``segments``."""
    _check(x, w_in, w_out, kind)
    if fp8 is not None:
        y = fp8_grouped_linear(x, w_in, offsets, fp8[0], b_in, segments, groups)   # (n, f_in)
        return fp8_grouped_linear(_act(y, kind, paths), w_out, offsets, fp8[1], b_out, segments,
                                  groups)                                           # (n, h_out)
    if not fused_path(x, w_in, w_out, (b_in, b_out), paths):
        y = grouped_linear(x, w_in, offsets, b_in, paths, groups)
        return grouped_linear(_act(y, kind, paths), w_out, offsets, b_out, paths, groups)
    if groups is None and (b_in is not None or b_out is not None):
        groups = row_groups(offsets, x.shape[0])
    return _GroupedMlpForwardGroupedMlpBackward.apply(x, w_in, b_in, w_out, b_out,
                                                      offsets.to(torch.int32), groups, kind, paths)


def grouped_mlp_reference(x: torch.Tensor, counts, w_in: torch.Tensor, w_out: torch.Tensor,
                          kind: str, b_in: torch.Tensor | None = None,
                          b_out: torch.Tensor | None = None) -> torch.Tensor:
    """The loop: each projection by ``grouped_linear_reference`` (``counts`` host integers), the
    plain activation between. (n, h) -> (n, h_out)."""
    _check(x, w_in, w_out, kind)
    y = grouped_linear_reference(x, w_in, counts, b_in)
    if kind == "gelu":
        y = F.gelu(y, approximate="tanh")
    else:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return grouped_linear_reference(y, w_out, counts, b_out)
