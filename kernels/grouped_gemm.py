"""Grouped GEMM: one linear layer per group of contiguous rows, as a mixture-of-experts layer runs
its experts on the rows sorted by expert.

``grouped_linear(x, weights, offsets, bias=None, paths=None)``: x (n, k) holding the rows of group
g at [offsets[g-1], offsets[g]) (``offsets`` (G,) an integer tensor on x's device: the cumulative
row counts, ``offsets[-1] == n``; empty groups allowed), weights (G, out, k) in nn.Linear's layout
(one stacked parameter), bias (G, out) or None -> (n, out), row r of group g being
``x[r] @ weights[g].T + bias[g]``. The offsets stay on the device: no path reads them on the host
except the loop below. The weights are used as they are (saved for backward as the parameter
itself: no stacked copy per call). The bias is added after the GEMM on every fused path (each row
gathers its group's bias by a ``searchsorted`` of the offsets), so no path depends on a kernel's
bias support. ``grouped_input_grad`` (dy_g @ W_g) and ``grouped_weight_grad`` (dy_g^T x_g, all G
at once) are the backward's two GEMMs, also called by the zero-bubble split of the experts
(models/moe/grouped_split.py).

- NPU, where the chip table lists it (``KernelPaths.grouped_matmul``, engine/device/chips.py):
  ``torch_npu.npu_grouped_matmul`` as documented in op-plugin 7.3.0
  (docs/context/torch_npu-npu_grouped_matmul.md) for the case where x, weight and y are each one
  tensor: ``x=[x]`` (n, k), not transposed; ``weight=[w]`` (G, k, out), 3-D, here a transposed view
  of the stacked (G, out, k) (a transposed weight is allowed); ``group_list`` the offsets as an
  int64 device tensor (``group_list_type=0``: cumulative, non-decreasing, so empty groups are fine),
  ``group_type=0`` (groups along m), ``split_item=3`` (one output tensor); fp16, bf16 or fp32 (fp32
  only in this one-tensor case), at most 1024 groups, k and out below the inner-axis limit 65536.
  The page documents the forward only, so the backward is written out here: the input gradient by
  the same op with the weight untransposed, the weight gradient a loop of per-group GEMMs (grouping
  along k is not among the ``group_type`` values the page gives for the A2/A3 training series),
  which reads the offsets on the host once per offsets tensor (one read per MoE layer and
  micro-batch in backward). Outside those rules the loop runs.
- ``torch._grouped_mm(x, w.transpose(1, 2), offs=offsets as int32)`` where the installed torch runs
  it for the device and dtype (probed once per pair with a tiny call; a refusal is an exception,
  so the probe reads nothing on the host): bf16 on CUDA (``TORCH_GROUPED_MM_DTYPES``; other dtypes
  take torch's fallback there, which this module does not rely on), fp32 and bf16 on the CPU of
  torch 2.13, bf16 on the meta device; every stride 16-byte aligned (k and out times the element
  size multiples of 16), and on CUDA the base pointers too. Its backward is two more grouped GEMMs
  (grad_x = grad @ w per group, grad_w = grad.T @ x per group); on CUDA grad_w's blocks of the
  groups without rows are set to zero on the device (``_gmm_wgrad``), since the kernel's output
  for a group over zero rows is not zero on every GPU (pytorch issue #172439, sm100).
- Otherwise the loop ``grouped_linear_reference`` (F.linear per group), which reads the offsets on
  the host (a wait on a device) and is the reference every path is tested against.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.dispatch import KernelPaths, device_kind, import_torch_npu

TORCH_GROUPED_MM_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.float32, torch.bfloat16),
                           "meta": (torch.bfloat16,)}
NPU_GROUPED_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NPU_MAX_GROUPS = 1024        # group_list length in the one-tensor case
NPU_INNER_LIMIT = 65536      # k and out must stay below it
ALIGN_BYTES = 16             # torch._grouped_mm: every non-unit stride (CUDA: base pointers too)


def _check(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, bias) -> None:
    if x.dim() != 2 or weights.dim() != 3 or weights.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_linear: x (n, k) and weights (G, out, k), got {tuple(x.shape)} "
                         f"and {tuple(weights.shape)}")
    if not isinstance(offsets, torch.Tensor) or tuple(offsets.shape) != (weights.shape[0],) \
            or offsets.is_floating_point():
        raise ValueError(f"grouped_linear: offsets must be an integer tensor of the {weights.shape[0]} "
                         f"groups' cumulative row counts, got {offsets!r:.80}")
    if bias is not None and tuple(bias.shape) != tuple(weights.shape[:2]):
        raise ValueError(f"grouped_linear: bias must be (G, out) = {tuple(weights.shape[:2])}, "
                         f"got {tuple(bias.shape)}")


def host_counts(offsets: torch.Tensor) -> list[int]:
    """The rows of each group as host integers: ONE host read per offsets tensor (remembered on
    it, so the projections and the backward of one MoE layer share it)."""
    counts = getattr(offsets, "_grouped_counts", None)
    if counts is None:
        ends = [int(v) for v in offsets.tolist()]
        counts = [b - a for a, b in zip([0] + ends[:-1], ends)]
        offsets._grouped_counts = counts
    return counts


def grouped_linear_reference(x: torch.Tensor, weights: torch.Tensor, counts,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The loop: F.linear on each group's rows, ``counts`` host integers. (n, k) -> (n, out)."""
    pieces = torch.split(x, list(counts))
    outs = [F.linear(p, weights[g], None if bias is None else bias[g]) for g, p in enumerate(pieces)]
    return torch.cat(outs) if outs else x.new_zeros((0, weights.shape[1]))


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The group of each of ``rows`` rows, on the device: (rows,) int64."""
    ends = offsets.to(torch.int64)
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)


def group_sum(grad: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Each group's rows summed, (n, out) -> (G, out) in grad's dtype: a bias's gradient, added in
    fp32 and rounded once. (``index_add_`` in bf16, autograd's backward of a row gather, is on
    CUDA one bf16 atomic add per element, rounded each time: a group of a few thousand rows loses
    most of its sum.) Element-wise work, as the bias's own gradient is: no GEMM the FLOPs
    counter would add to the model's; the fp32 copy of ``grad`` is transient."""
    total = torch.zeros((num_groups, grad.shape[1]), dtype=torch.float32, device=grad.device)
    return total.index_add_(0, groups, grad.float()).to(grad.dtype)


class _GatherRowsForwardGroupSumBackward(torch.autograd.Function):
    """bias (G, out) -> (n, out), row r holding its group's bias; backward ``group_sum``."""

    @staticmethod
    def forward(ctx, bias, groups):
        ctx.save_for_backward(groups)
        ctx.num_groups = bias.shape[0]
        return bias.index_select(0, groups)

    @staticmethod
    def backward(ctx, grad):
        groups, = ctx.saved_tensors
        return group_sum(grad, groups, ctx.num_groups), None


# ---- torch._grouped_mm -----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)  # a fact about the installed torch and the device type
def _probe(device_type: str, dtype: torch.dtype) -> bool:
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or dtype not in TORCH_GROUPED_MM_DTYPES.get(device_type, ()):
        return False
    from torch.utils._python_dispatch import _disable_current_modes
    try:  # outside any dispatch mode (a FLOP counter, the wait counter): not the caller's work
        with _disable_current_modes():
            a = torch.ones(16, 16, dtype=dtype, device=device_type)
            b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
            fn(a, b.transpose(1, 2), offs=torch.arange(8, 17, 8, dtype=torch.int32, device=device_type))
        return True
    except Exception:  # noqa: BLE001 - any refusal (no kernel, no device, no dtype) means no
        return False


@torch.compiler.assume_constant_result  # traced graphs take the answer as a constant
def torch_grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch runs ``torch._grouped_mm`` for ``dtype`` on ``device_type`` (a tiny call
    once per pair; a refusal raises, so nothing is read back)."""
    return _probe(device_type, dtype)


# torch._grouped_mm as an operator of this package: its own shape function serves every dtype
# under torch.compile (torch's meta function takes bf16 alone), and a compiled graph calls the
# kernel as it is. The same semantics: (n, k) x (G, k, out) -> (n, out) grouped along n, or
# (out, n) x (n, k) -> (G, out, k) grouped along n (the weight gradient).
@torch.library.custom_op("gridtron::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _grouped_mm_shape(a, b, offs):
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Every row meets one group's matrix: 2 n k out either way ((n, k) x (G, k, out), or the
    weight gradient's (out, n) x (n, k)), as torch.utils.flop_counter counts a matmul."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


try:  # the FLOP counter (engine/plan/flops.py's check, and blocks without a formula) sees it
    from torch.utils.flop_counter import flop_registry, register_flop_formula
    for _op in (torch.ops.gridtron.grouped_mm, getattr(torch.ops.aten, "_grouped_mm", None)):
        if _op is not None and _op.default not in flop_registry:
            register_flop_formula(_op)(_grouped_mm_flops)
except ImportError:  # an older torch without the registry: the counter misses the experts
    pass


def grouped_mm_aligned(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """torch._grouped_mm's rule for this GEMM and its backward: x (n, k or out) and the stacked
    weights (G, out, k) contiguous, k and out times the element size multiples of 16 (every row
    of every operand and output starts on 16 bytes); on CUDA the base pointers 16-byte aligned
    too."""
    if not (x.is_contiguous() and weights.is_contiguous()
            and _widths_aligned(x.element_size(), *weights.shape[1:])):
        return False
    if x.device.type != "cuda" or torch.compiler.is_compiling():  # (compiled: aligned buffers)
        return True
    return x.data_ptr() % ALIGN_BYTES == 0 and weights.data_ptr() % ALIGN_BYTES == 0


def _widths_aligned(element_size: int, *widths: int) -> bool:
    return all(w * element_size % ALIGN_BYTES == 0 for w in widths)


class _GroupedMmForwardGroupedMmBackward(torch.autograd.Function):
    """y = x @ w[g].T per group by torch._grouped_mm; backward two grouped GEMMs."""

    @staticmethod
    def forward(ctx, x, weights, offs):  # (n, k), (G, out, k), (G,) int32
        ctx.save_for_backward(x, weights, offs)
        return _gmm(x, weights.transpose(1, 2), offs)  # (n, out)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        x, weights, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _gmm(grad, weights, offs) if ctx.needs_input_grad[0] else None
        grad_w = _gmm_wgrad(grad.t(), x, offs) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None  # (n, k), (G, out, k)


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm``: in a compiled graph the operator (its shape function serves every dtype),
    eagerly torch's kernel itself (the operator's dispatch layers cost host time)."""
    if torch.compiler.is_compiling():
        return grouped_mm(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


# device types whose torch._grouped_mm output for a group over zero rows is not relied on
# (pytorch issue #172439: not zero on sm100); the CPU's kernel, a GEMM per group, writes zeros,
# and a mask there would cost a pass over every weight gradient on the host
MASK_EMPTY_GROUPS = frozenset({"cuda"})


def _gmm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A weight gradient by ``_gmm`` grouped along the rows, (out, n) x (n, k) -> (G, out, k),
    on a device of ``MASK_EMPTY_GROUPS`` with every group that has no rows set to zero on the
    device (no host read). The FP8 weight gradient masks its empty groups the same way
    (kernels/fp8_grouped.py)."""
    dw = _gmm(a, b, offs)                                                   # (G, out, k)
    if dw.device.type not in MASK_EMPTY_GROUPS:
        return dw
    counts = torch.diff(offs, prepend=offs.new_zeros(1))                    # (G,)
    return dw.masked_fill_((counts == 0).view(-1, 1, 1), 0)


# ---- NPU: torch_npu.npu_grouped_matmul -----------------------------------------------------------

def npu_grouped_matmul_fits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """The documented input rules of the one-tensor case (see the module docstring)."""
    return (x.dtype in NPU_GROUPED_MATMUL_DTYPES and weights.dtype == x.dtype
            and 1 <= weights.shape[0] <= NPU_MAX_GROUPS
            and max(weights.shape[1:]) < NPU_INNER_LIMIT)


def _npu_gmm(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    torch_npu = import_torch_npu()
    return torch_npu.npu_grouped_matmul([x], [weight], group_list=group_list, split_item=3,
                                        group_type=0, group_list_type=0)[0]


class _NpuGroupedMatmulForwardGroupedMatmulBackward(torch.autograd.Function):
    """y = x @ w[g].T per group by npu_grouped_matmul; grad_x by the same op, grad_w a loop."""

    @staticmethod
    def forward(ctx, x, weights, offsets):  # (n, k), (G, out, k), (G,) on the device
        group_list = offsets.to(torch.int64)
        ctx.save_for_backward(x, weights, group_list)
        ctx.offsets = offsets
        return _npu_gmm(x, weights.transpose(1, 2), group_list)  # (n, out)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        x, weights, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _npu_gmm(grad, weights, group_list) if ctx.needs_input_grad[0] else None  # (n, k)
        grad_w = _loop_weight_grad(grad, x, ctx.offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _loop_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    counts = host_counts(offsets)
    pairs = zip(torch.split(grad, counts), torch.split(x, counts))
    return torch.stack([g.t() @ xs for g, xs in pairs])  # (G, out, k)


# ---- dispatch ------------------------------------------------------------------------------------

def grouped_linear_path(x: torch.Tensor, weights: torch.Tensor,
                        paths: KernelPaths | None = None) -> str:
    """Which path ``grouped_linear`` takes for these operands: "npu", "torch" or "loop"."""
    kind = device_kind(x)
    if weights.dtype != x.dtype:
        return "loop"
    if kind == "npu":
        fused = (paths is None or paths.grouped_matmul) and npu_grouped_matmul_fits(x, weights)
        return "npu" if fused else "loop"
    if torch_grouped_mm_runs(x.device.type, x.dtype) and grouped_mm_aligned(x, weights):
        return "torch"
    return "loop"


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                   bias: torch.Tensor | None = None, paths: KernelPaths | None = None,
                   groups: torch.Tensor | None = None) -> torch.Tensor:
    """Row group g of x (rows [offsets[g-1], offsets[g])) times ``weights[g].T`` plus ``bias[g]``:
    (n, k) -> (n, out). ``paths``: the chip's fused ops (None: all); ``groups``: ``row_groups``
    of the offsets when the caller has it (computed here otherwise)."""
    _check(x, weights, offsets, bias)
    path = grouped_linear_path(x, weights, paths)
    if path == "loop" or x.shape[0] == 0:
        counts = host_counts(offsets) if x.shape[0] else [0] * weights.shape[0]
        return grouped_linear_reference(x, weights, counts, bias)
    if path == "npu":
        y = _NpuGroupedMatmulForwardGroupedMatmulBackward.apply(x.contiguous(), weights.contiguous(),
                                                                offsets)
    else:
        y = _GroupedMmForwardGroupedMmBackward.apply(x, weights, offsets.to(torch.int32))
    return add_group_bias(y, bias, offsets, groups)


def add_group_bias(y: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor,
                   groups: torch.Tensor | None = None) -> torch.Tensor:
    """y (n, out) plus each row's group's bias (G, out) after a grouped GEMM (``y`` itself without
    a bias); ``groups``: ``row_groups`` of the offsets when the caller has it."""
    if bias is None:
        return y
    groups = row_groups(offsets, y.shape[0]) if groups is None else groups
    return y + _GatherRowsForwardGroupSumBackward.apply(bias, groups).to(y.dtype)


def grouped_input_grad(grad: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
                       paths: KernelPaths | None = None) -> torch.Tensor:
    """dy_g @ W_g per group (no autograd): (n, out), (G, out, k) -> (n, k)."""
    grad = grad.contiguous()
    if grad.shape[0] == 0:
        return grad.new_zeros((0, weights.shape[2]))
    path = grouped_linear_path(grad, weights, paths)
    if path == "npu":
        return _npu_gmm(grad, weights, offsets.to(torch.int64))
    if path == "torch":
        return _gmm(grad, weights, offsets.to(torch.int32))
    counts = host_counts(offsets)
    return torch.cat([g @ weights[i] for i, g in enumerate(torch.split(grad, counts))])


def grouped_weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                        paths: KernelPaths | None = None) -> torch.Tensor:
    """dy_g^T x_g for every group at once (no autograd): (n, out), (n, k) -> (G, out, k); an
    empty group's is zero."""
    grad, x = grad.contiguous(), x.contiguous()
    if grad.shape[0] == 0:
        return grad.new_zeros((offsets.shape[0], grad.shape[1], x.shape[1]))
    if device_kind(x) != "npu" and grad.dtype == x.dtype \
            and torch_grouped_mm_runs(x.device.type, x.dtype) \
            and _widths_aligned(x.element_size(), grad.shape[1], x.shape[1]):
        return _gmm_wgrad(grad.t(), x, offsets.to(torch.int32))
    return _loop_weight_grad(grad, x, offsets)
