"""Grouped GEMM: one linear layer per group of contiguous rows, as a mixture-of-experts layer runs
its experts on the rows sorted by expert.

``grouped_linear(x, weights, counts, bias=None, paths=None)``: x (n, k) holding ``counts[g]`` rows
of group g in order (a host list summing to n; empty groups allowed), weights (G, out, k) in
nn.Linear's layout (the experts' weights stacked), bias (G, out) or None -> (n, out), row r of group
g being ``x[r] @ weights[g].T + bias[g]``. The bias is added after the GEMM on every fused path
(each row gathers its group's bias), so no path depends on a kernel's bias support.

- NPU, where the chip table lists it (``KernelPaths.grouped_matmul``, engine/device/chips.py):
  ``torch_npu.npu_grouped_matmul`` as documented in op-plugin 7.3.0
  (docs/context/torch_npu-npu_grouped_matmul.md) for the case where x, weight and y are each one
  tensor: ``x=[x]`` (n, k), not transposed; ``weight=[w]`` (G, k, out), 3-D, here a transposed view
  of the stacked (G, out, k) (a transposed weight is allowed); ``group_list`` an int64 tensor of the
  cumulative row counts (``group_list_type=0``: non-negative and non-decreasing, so empty groups
  are fine; its last value is n), ``group_type=0`` (groups along m), ``split_item=3`` (one output
  tensor); fp16, bf16 or fp32 (fp32 only in this one-tensor case), at most 1024 groups, k and out
  below the inner-axis limit 65536. The page documents the forward only, so the backward is written
  out here: the input gradient by the same op with the weight untransposed, the weight gradient a
  loop of per-group GEMMs (grouping along k is not among the ``group_type`` values the page gives
  for the A2/A3 training series). Outside those rules the loop runs.
- CUDA: ``torch._grouped_mm(x, w.transpose(1, 2), offs=cumulative counts as int32)`` where the
  installed torch has it (probed once per device with a tiny call), in bf16
  (``TORCH_GROUPED_MM_DTYPES``) with every stride 16-byte aligned; its backward is two more grouped GEMMs (grad_x = grad @ w per
  group, grad_w = grad.T @ x per group). Otherwise the loop.
- CPU and any other device: the loop ``grouped_linear_reference`` (F.linear per group), which is
  also the reference every path is tested against. torch 2.13 has a CPU ``torch._grouped_mm`` (fp32,
  bf16, 16-byte aligned strides); the tests run the CUDA path's code through it.
"""
from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from kernels.dispatch import KernelPaths, device_kind, import_torch_npu

TORCH_GROUPED_MM_DTYPES = (torch.bfloat16,)   # what the CUDA path hands to torch._grouped_mm
NPU_GROUPED_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NPU_MAX_GROUPS = 1024        # group_list length in the one-tensor case
NPU_INNER_LIMIT = 65536      # k and out must stay below it
ALIGN_BYTES = 16             # torch._grouped_mm: every non-unit stride and the base pointers


def _check(x: torch.Tensor, weights: torch.Tensor, counts, bias) -> None:
    if x.dim() != 2 or weights.dim() != 3 or weights.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_linear: x (n, k) and weights (G, out, k), got {tuple(x.shape)} "
                         f"and {tuple(weights.shape)}")
    if len(counts) != weights.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"grouped_linear: counts {list(counts)} must give each of the "
                         f"{weights.shape[0]} groups its rows, summing to x's {x.shape[0]}")
    if bias is not None and tuple(bias.shape) != tuple(weights.shape[:2]):
        raise ValueError(f"grouped_linear: bias must be (G, out) = {tuple(weights.shape[:2])}, "
                         f"got {tuple(bias.shape)}")


def grouped_linear_reference(x: torch.Tensor, weights: torch.Tensor, counts,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The loop: F.linear on each group's rows. (n, k) -> (n, out)."""
    _check(x, weights, counts, bias)
    pieces = torch.split(x, list(counts))
    outs = [F.linear(p, weights[g], None if bias is None else bias[g]) for g, p in enumerate(pieces)]
    return torch.cat(outs) if outs else x.new_zeros((0, weights.shape[1]))


def _cumulative(counts, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(list(itertools.accumulate(counts)), dtype=dtype, device=device)


def _group_bias(bias: torch.Tensor, counts, rows: int) -> torch.Tensor:
    """(G, out) -> (n, out): each row its group's bias."""
    repeats = torch.tensor(list(counts), dtype=torch.long, device=bias.device)
    return bias.repeat_interleave(repeats, dim=0, output_size=rows)


# ---- CUDA: torch._grouped_mm ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)  # a fact about the installed torch and the device
def torch_grouped_mm_runs(device: str) -> bool:
    """Whether this torch has ``torch._grouped_mm`` and it runs a tiny bf16 call on ``device``."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        b = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device)
        out = fn(a, b.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def grouped_mm_aligned(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """torch._grouped_mm's rule: rows of x, of the weights and of the output start on 16 bytes
    (x and the stacked weights contiguous, k and out times the element size multiples of 16)."""
    es = x.element_size()
    return (x.is_contiguous() and weights.is_contiguous()
            and x.shape[1] * es % ALIGN_BYTES == 0 and weights.shape[1] * es % ALIGN_BYTES == 0
            and x.data_ptr() % ALIGN_BYTES == 0 and weights.data_ptr() % ALIGN_BYTES == 0)


class _GroupedMmForwardGroupedMmBackward(torch.autograd.Function):
    """y = x @ w[g].T per group by torch._grouped_mm; backward two grouped GEMMs."""

    @staticmethod
    def forward(ctx, x, weights, offs):  # (n, k), (G, out, k), (G,) int32
        ctx.save_for_backward(x, weights, offs)
        return torch._grouped_mm(x, weights.transpose(1, 2), offs=offs)  # (n, out)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        x, weights, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, weights, offs=offs) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(grad.t(), x, offs=offs) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None  # (n, k), (G, out, k)


def torch_grouped_linear(x: torch.Tensor, weights: torch.Tensor, counts) -> torch.Tensor:
    """The CUDA path's GEMM on any device torch._grouped_mm runs on (no bias; operands as
    ``grouped_mm_aligned`` requires). (n, k) -> (n, out)."""
    offs = _cumulative(counts, torch.int32, x.device)
    return _GroupedMmForwardGroupedMmBackward.apply(x, weights, offs)


# ---- NPU: torch_npu.npu_grouped_matmul -----------------------------------------------------------

def npu_grouped_matmul_fits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """The documented input rules of the one-tensor case (see the module docstring)."""
    return (x.dtype in NPU_GROUPED_MATMUL_DTYPES and weights.dtype == x.dtype
            and 1 <= weights.shape[0] <= NPU_MAX_GROUPS
            and max(x.shape[1], weights.shape[1]) < NPU_INNER_LIMIT)


def _npu_gmm(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    torch_npu = import_torch_npu()
    return torch_npu.npu_grouped_matmul([x], [weight], group_list=group_list, split_item=3,
                                        group_type=0, group_list_type=0)[0]


class _NpuGroupedMatmulForwardGroupedMatmulBackward(torch.autograd.Function):
    """y = x @ w[g].T per group by npu_grouped_matmul; grad_x by the same op, grad_w a loop."""

    @staticmethod
    def forward(ctx, x, weights, group_list, counts):  # (n, k), (G, out, k), (G,) int64, list
        ctx.save_for_backward(x, weights, group_list)
        ctx.counts = list(counts)
        return _npu_gmm(x, weights.transpose(1, 2), group_list)  # (n, out)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        x, weights, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _npu_gmm(grad, weights, group_list) if ctx.needs_input_grad[0] else None  # (n, k)
        grad_w = None
        if ctx.needs_input_grad[1]:
            pairs = zip(torch.split(grad, ctx.counts), torch.split(x, ctx.counts))
            grad_w = torch.stack([g.t() @ xs for g, xs in pairs])  # (G, out, k)
        return grad_x, grad_w, None, None


def npu_grouped_linear(x: torch.Tensor, weights: torch.Tensor, counts) -> torch.Tensor:
    """The NPU path's GEMM (no bias). (n, k) -> (n, out)."""
    group_list = _cumulative(counts, torch.int64, x.device)
    return _NpuGroupedMatmulForwardGroupedMatmulBackward.apply(x.contiguous(), weights.contiguous(),
                                                               group_list, counts)


# ---- dispatch ------------------------------------------------------------------------------------

def grouped_linear_path(x: torch.Tensor, weights: torch.Tensor,
                        paths: KernelPaths | None = None) -> str:
    """Which path ``grouped_linear`` takes for these operands: "npu", "torch" or "loop"."""
    kind = device_kind(x)
    if weights.dtype != x.dtype or x.shape[0] == 0:
        return "loop"
    if kind == "npu":
        fused = (paths is None or paths.grouped_matmul) and npu_grouped_matmul_fits(x, weights)
        return "npu" if fused else "loop"
    if kind == "cuda" and x.dtype in TORCH_GROUPED_MM_DTYPES and grouped_mm_aligned(x, weights) \
            and torch_grouped_mm_runs(str(x.device)):
        return "torch"
    return "loop"


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, counts,
                   bias: torch.Tensor | None = None, paths: KernelPaths | None = None) -> torch.Tensor:
    """Row group g of x (``counts[g]`` rows) times ``weights[g].T`` plus ``bias[g]``: (n, k) ->
    (n, out). ``paths``: the chip's fused ops (None: all)."""
    _check(x, weights, counts, bias)
    path = grouped_linear_path(x, weights, paths)
    if path == "loop":
        return grouped_linear_reference(x, weights, counts, bias)
    y = (npu_grouped_linear if path == "npu" else torch_grouped_linear)(x, weights, counts)
    return y if bias is None else y + _group_bias(bias, counts, x.shape[0]).to(y.dtype)
