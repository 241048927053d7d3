"""FP8 grouped GEMMs: the experts' projections (``kernels.grouped_linear``) on float8 operands,
forward and both backward GEMMs, each with its reference. Rows sorted by group, ``offsets`` (G,)
their cumulative counts on the device, weights (G, out, in):

    forward          y = x W_g^T         x per row (over in)           W per (g, output row)
    input gradient   dx = dy W_g         dy per row (over out)         W per (g, input column)
    weight gradient  dW_g = dy_g^T x_g   dy per (segment, column)      x per (segment, column)

Every scale runs along its GEMM's contraction dimension, rounded down to a power of two (torchao's
rowwise recipe, what its MoE training hands ``torch._scaled_grouped_mm``, which takes rowwise
scales only) whatever ``--fp8-recipe`` says (docs/precision.md). x and W are e4m3, dy the recipe's
gradient format (hybrid: e5m2). The weight gradient's column scales are per segment: ``segments``
(S,) cumulative row ends refining the groups, R = S / G per group (segment s in group s // R), the
rows a group holds from one source (under expert parallelism an EP rank: one micro-batch of the
serial run). Each segment is one scaled GEMM, a group's R products summed in fp32; rows past the
last segment end (copies a capacity dropped: gradient zero) are left out.

Paths, one choice per GEMM and the same on every device (as ``kernels.fp8.scaled_mm`` applies
CUDA's rules everywhere):

- ``torch._scaled_grouped_mm`` where ``scaled_grouped_mm_runs(device type)`` and its rules hold
  (``fused_refusal``): both operands e4m3 (under hybrid the backward's e5m2 gradient takes the
  loop), the first row-major, the second column-major per group, K and N multiples of 16, fp32
  scales (n,) and (G, N) (weight gradient, grouped along K: (S M,) and (S N,)), int32 offsets on the
  device, bf16 out, fewer than 1024 groups (segments): ScaledGroupMM.cu's sm90 limit, which the meta
  device does not check (``MAX_GROUPS``; more take the loop). The forward's GEMM accumulates fast
  (``use_fast_accum``, as ``kernels.fp8.scaled_mm``'s forward). The weight gradient pads each
  segment with zero rows to a multiple of 16 within a static bound of n + 15 S rows (no host read).
- elsewhere (the CPU: torch 2.13 registers the op for CUDA only) the SAME quantized operands and
  scales through ``kernels.fp8.scaled_mm`` per group (per segment, zero-padded alike):
  ``torch._scaled_mm``'s real FP8 GEMM, or its reference outside its rules (an odd width). The
  loop reads the offsets on the host once per offsets tensor; on the meta device (the dry run:
  no values to read) it is its output's shape alone.

``scaled_grouped_mm_reference`` and ``scaled_grouped_wgrad_reference`` dequantize and multiply in
fp32 per group (segment): the definition both paths are held to (tests/kernels/test_fp8_grouped.py).
Scales over the logical tensor (``GroupedFp8Spec``): each amax is MAX-reduced through the engine's
``CommGroup`` (``kernels.fp8.Amaxes``, one all-reduce per group and pass) over the groups that shard
its axis: the input features (fc2 under expert tensor parallelism), the output features (fc1),
the rows of a segment (TP under sequence parallelism without ETP, CP at ep 1), and under expert
parallelism with CP the segments of one micro-batch, on the rank and over the experts' replicas
(``SegmentSlots``). Nothing FP8 is kept for backward: it quantizes again from the saved bf16
tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.fp8 import (ALIGN, E4M3, Amaxes, Fp8Recipe, amax, amax_to_scale, quantize,
                         scaled_grouped_mm_runs, scaled_mm)
from kernels.grouped_gemm import _check, add_group_bias, host_counts, row_groups

MAX_GROUPS = 1024   # torch._scaled_grouped_mm on sm90: "Can't process more than 1024 groups"


@dataclass(frozen=True, eq=False)
class GroupedFp8Spec:
    """One projection's FP8: the recipe (its gradient format) and the groups (the engine's
    CommGroups) its amaxes are reduced over (module docstring); ``loop``: the per-group loop even
    where the grouped kernel runs (``--no-moe-grouped-gemm``)."""
    recipe: Fp8Recipe
    in_groups: tuple = ()       # shard the input features: the forward's contraction
    out_groups: tuple = ()      # shard the output features: the input gradient's contraction
    token_groups: tuple = ()    # hold other rows of the same segments: the weight gradient's
    loop: bool = False
    slots: "SegmentSlots | None" = None   # segments that are parts of one micro-batch (EP x CP)


@dataclass(frozen=True)
class SegmentSlots:
    """Which weight-gradient segments hold rows of the same micro-batch of the serial run, where
    one micro-batch's rows of an expert arrive as several segments, on this rank or on others
    (expert parallelism under context parallelism: the CP slices of a sequence are different EP
    sources and may belong to different EP groups). A group's ``sources`` segments come from
    consecutive positions ``first`` .. ``first + sources - 1`` of the DP x CP ranks in rank order,
    so source j's micro-batch is ``(first + j) // stride % slots`` (``slots``: dp; ``stride``: cp
    where CP varies faster than DP in the rank order, 1 where DP does:
    parallel/grid/expert_groups.py ``micro_stride``). The
    column amaxes are MAX-reduced per (group, micro-batch) on the rank, then over ``group`` (the
    ranks holding the same experts: EDP), and every segment takes its micro-batch's.

    With ``RankGrid(cp=4)`` and ep 2: EP [0, 1], [2, 3], EDP [0, 2], [1, 3]; rank 2 holds experts
    0-1 of 4 and receives from positions 2 and 3 (``first`` 2), both CP slices of micro-batch 0:
    its segments (expert 0, source 0) and (expert 0, source 1) merge on the rank, and rank 0's two
    segments of expert 0 (positions 0 and 1, micro-batch 0 too) join them over EDP."""
    first: int
    sources: int
    stride: int
    slots: int
    group: object = None

    def index(self, segments: int, device) -> torch.Tensor:
        """(S,) each segment's slot among ``groups * slots``, group-major."""
        s = torch.arange(segments, device=device)
        mb = torch.div(self.first + s % self.sources, self.stride, rounding_mode="floor") % self.slots
        return torch.div(s, self.sources, rounding_mode="floor") * self.slots + mb


def _scale(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return amax_to_scale(a, dtype, power_of_two=True)


def _quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.fp8.quantize``, eagerly on every device: the row counts change every call, which
    the CUDA path's compiled expression (static shapes) would recompile for."""
    return quantize(t, scale, dtype, compiled=False)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)   # float8 bytes: padding and row copies on every device


def fused_refusal(a: torch.Tensor, b: torch.Tensor, k: int, n: int, out_dtype: torch.dtype,
                  loop: bool = False, groups: int = 1) -> str | None:
    """Why the grouped kernel does not take this GEMM (K = ``k``, N = ``n``, ``groups`` groups),
    or None."""
    if loop or not scaled_grouped_mm_runs(a.device.type):
        return "no torch._scaled_grouped_mm on this device"
    if groups >= MAX_GROUPS:
        return f"torch._scaled_grouped_mm takes fewer than {MAX_GROUPS} groups, got {groups}"
    if a.dtype != E4M3 or b.dtype != E4M3:
        return "torch._scaled_grouped_mm takes e4m3 operands only"
    if out_dtype != torch.bfloat16:
        return "torch._scaled_grouped_mm writes bf16 only"
    if k % ALIGN or n % ALIGN:
        return f"K={k} and N={n} must be multiples of {ALIGN}"
    return None


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offsets: torch.Tensor, out_dtype: torch.dtype, loop: bool = False,
                      fast_accum: bool = False) -> torch.Tensor:
    """a (n, K) float8 row-major, rows sorted by group; b (G, K, N) float8, each group column-major;
    dequantization scales (n,) and (G, N) fp32 -> (n, N): row r of group g is
    (a[r] scale_a[r]) @ (b[g] scale_b[g]). ``fast_accum``: the forward GEMM's accumulation."""
    (rows, k), n = a.shape, b.shape[2]
    if rows == 0:
        return a.new_zeros((0, n), dtype=out_dtype)
    if fused_refusal(a, b, k, n, out_dtype, loop, b.shape[0]) is None:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets.to(torch.int32),
                                        out_dtype=out_dtype, use_fast_accum=fast_accum)
    if a.device.type == "meta":   # the loop's shape: no offsets to read (module docstring)
        return a.new_empty((rows, n), dtype=out_dtype)
    outs, start = [], 0
    for g, count in enumerate(host_counts(offsets)):
        end = start + count
        if count:
            # the group's row scales copied, so they start aligned (a slice at any row may not;
            # cuBLASLt documents no alignment rule for scale pointers: a copy needs none); row g
            # of the (G, N) scales starts aligned already (N a multiple of 16)
            rows_scale = scale_a[start:end].reshape(-1, 1).clone()
            outs.append(scaled_mm(a[start:end], b[g], rows_scale, scale_b[g].view(1, -1),
                                  out_dtype, fast_accum=fast_accum))
        start = end
    return torch.cat(outs)


def scaled_grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                                scale_b: torch.Tensor, counts, out_dtype: torch.dtype) -> torch.Tensor:
    """``scaled_grouped_mm`` by definition: each group's dequantized rows times its dequantized
    matrix in fp32 (``counts`` host integers)."""
    outs, start = [], 0
    for g, count in enumerate(counts):
        end = start + count
        outs.append((a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g]))
        start = end
    return torch.cat(outs).to(out_dtype) if outs else a.new_zeros((0, b.shape[2]), dtype=out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """t (c, m) float8 with zero rows appended up to a multiple of 16."""
    return F.pad(_u8(t), (0, 0, 0, -t.shape[0] % ALIGN)).view(t.dtype)


def _fused_wgrad(a, b, scale_a, scale_b, segments, out_dtype):
    """(S, M, N) by torch._scaled_grouped_mm grouped along the rows, each segment zero-padded."""
    n, s = a.shape[0], segments.numel()
    ends = segments.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))                   # (S,)
    padded = torch.div(counts + ALIGN - 1, ALIGN, rounding_mode="floor") * ALIGN
    padded_start = torch.cumsum(padded, 0) - padded
    total = -(-(n + (ALIGN - 1) * s) // ALIGN) * ALIGN                       # static bound
    seg = row_groups(segments, n)                                           # (n,) S: left out
    at = seg.clamp(max=s - 1)
    dest = padded_start[at] + torch.arange(n, device=a.device) - (ends - counts)[at]
    dest = torch.where(seg < s, dest, torch.full_like(dest, total))         # a spare row
    rows = [torch.zeros(total + 1, t.shape[1], dtype=torch.uint8, device=t.device)
            .index_copy_(0, dest, _u8(t))[:total].view(t.dtype) for t in (a, b)]
    first = rows[0].t().contiguous()                                        # (M, total) row-major
    second = rows[1].t().contiguous().t()                                   # (total, N) col-major
    offs = torch.cat([torch.cumsum(padded, 0)[:-1], padded.new_full((1,), total)]).to(torch.int32)
    out = torch._scaled_grouped_mm(first, second, scale_a.reshape(-1), scale_b.reshape(-1),
                                   offs=offs, out_dtype=out_dtype)          # (S, M, N)
    return torch.where((counts > 0).view(-1, 1, 1), out, out.new_zeros(()))  # empty: zero


def scaled_grouped_wgrad(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                         scale_b: torch.Tensor, segments: torch.Tensor, groups: int,
                         out_dtype: torch.dtype, loop: bool = False) -> torch.Tensor:
    """a (n, M) and b (n, N) float8, rows sorted by segment (``segments`` (S,) cumulative ends, S =
    ``groups`` R), per-(segment, column) dequantization scales (S, M) and (S, N) fp32 -> (G, M, N):
    group g's sum over its segments s of (a_s scale_a[s])^T (b_s scale_b[s]), one scaled GEMM per
    segment, summed in fp32 (module docstring); rows past segments[-1] are left out."""
    (n, m), k = a.shape, b.shape[1]
    s = segments.numel()
    r = s // groups
    if n == 0:
        return a.new_zeros((groups, m, k), dtype=out_dtype)
    if fused_refusal(a, b, m, k, out_dtype, loop, s) is None:
        out = _fused_wgrad(a, b, scale_a, scale_b, segments, out_dtype)
        return out if r == 1 else out.view(groups, r, m, k).float().sum(1).to(out_dtype)
    if a.device.type == "meta":
        return a.new_empty((groups, m, k), dtype=out_dtype)
    out = torch.zeros(groups, m, k, dtype=torch.float32, device=a.device)
    start = 0
    for i, count in enumerate(host_counts(segments)):
        end = start + count
        if count:
            first = _pad_rows(a[start:end]).t().contiguous()                   # (M, c16) row-major
            second = _pad_rows(b[start:end]).t().contiguous().t()              # (c16, N) col-major
            out[i // r] += scaled_mm(first, second, scale_a[i].view(-1, 1), scale_b[i].view(1, -1),
                                     out_dtype).float()
        start = end
    return out.to(out_dtype)


def scaled_grouped_wgrad_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                                   scale_b: torch.Tensor, counts, groups: int,
                                   out_dtype: torch.dtype) -> torch.Tensor:
    """``scaled_grouped_wgrad`` by definition (``counts``: the segments' rows, host integers)."""
    r = len(counts) // groups
    out = torch.zeros(groups, a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for i, count in enumerate(counts):
        end = start + count
        out[i // r] += (a[start:end].float() * scale_a[i]).t() @ (b[start:end].float() * scale_b[i])
        start = end
    return out.to(out_dtype)


def _segment_amax(t: torch.Tensor, seg: torch.Tensor, s: int) -> torch.Tensor:
    """max |t| per (bin, column): (n, k) rows in bins ``seg`` (n,) -> (S, k) fp32, the bins being
    segments or their micro-batch slots; rows of bin S (past the last end) are left out."""
    out = torch.zeros(s + 1, t.shape[1], dtype=torch.float32, device=t.device)
    index = seg.view(-1, 1).expand(t.shape)                                # a view: no copy
    return out.scatter_reduce_(0, index, t.float().abs(), "amax")[:s]


def _inv(scale: torch.Tensor, *shape) -> torch.Tensor:
    return scale.reciprocal().reshape(*shape).contiguous()


class Fp8GroupedForward:
    """The scales of one forward call, x per row and W per (group, output row), both over the
    input features (reduced over ``spec.in_groups``), and its GEMM."""

    def __init__(self, spec: GroupedFp8Spec, x: torch.Tensor, weight: torch.Tensor):
        am = Amaxes()
        am.add(amax(x, -1), spec.in_groups)                                # (n, 1)
        am.add(amax(weight, -1), spec.in_groups)                           # (G, out, 1)
        ax, aw = am.reduce()
        self.spec, self.x_scale, self.w_scale = spec, _scale(ax, E4M3), _scale(aw, E4M3)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(n, in) -> (n, out): row group g times W_g^T, from float8 operands."""
        g, out = weight.shape[:2]
        a = _quantize(x, self.x_scale, E4M3)                                # (n, in) row-major
        b = _quantize(weight, self.w_scale, E4M3).transpose(1, 2)           # (G, in, out) col-major
        return scaled_grouped_mm(a, b, _inv(self.x_scale, -1), _inv(self.w_scale, g, out), offsets,
                                 x.dtype, self.spec.loop, fast_accum=True)   # the forward GEMM


class Fp8GroupedBackward:
    """The scales of one backward call, agreed over the groups (one reduction per group): dy per
    row and W per (group, input column) over the output features (``spec.out_groups``); dy and x
    per (segment, column) over the rows (``spec.token_groups``; with ``spec.slots``, per (group,
    micro-batch) over the segments of one micro-batch too). ``dgrad`` and ``wgrad`` run the two
    GEMMs."""

    def __init__(self, spec: GroupedFp8Spec, grad: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, offsets: torch.Tensor, segments: torch.Tensor):
        self.spec, self.grad, self.x, self.weight = spec, grad, x, weight
        self.offsets, self.segments = offsets, segments
        s = segments.numel()
        self.seg = row_groups(segments, grad.shape[0])                    # (n,) each row's segment
        am = Amaxes()
        am.add(amax(grad, -1), spec.out_groups)                            # (n, 1)
        am.add(amax(weight, 1), spec.out_groups)                           # (G, 1, in)
        slots, groups, bins, rows = spec.slots, spec.token_groups, s, self.seg
        if slots is not None:  # per (group, micro-batch), over the replicas too
            index = slots.index(s, grad.device)                            # (S,) each one's slot
            bins = weight.shape[0] * slots.slots                           # G dp
            rows = torch.cat([index, index.new_full((1,), bins)]).index_select(0, rows)
            groups = groups + (slots.group,)
        am.add(_segment_amax(grad, rows, bins), groups)                    # (S or G dp, out)
        am.add(_segment_amax(x, rows, bins), groups)                       # (S or G dp, in)
        g_rows, w_cols, g_cols, x_cols = am.reduce()
        if slots is not None:  # each segment its micro-batch's
            g_cols, x_cols = g_cols.index_select(0, index), x_cols.index_select(0, index)
        gd = spec.recipe.grad_dtype
        self.g_rows, self.w_cols = _scale(g_rows, gd), _scale(w_cols, E4M3)
        self.g_cols, self.x_cols = _scale(g_cols, gd), _scale(x_cols, E4M3)

    def dgrad(self) -> torch.Tensor:
        """dy_g W_g per row group: (n, out) -> (n, in)."""
        g, _, k = self.weight.shape
        a = _quantize(self.grad, self.g_rows, self.spec.recipe.grad_dtype)  # (n, out) row-major
        b = _quantize(self.weight, self.w_cols, E4M3)                       # (G, out, in)
        b = b.transpose(1, 2).contiguous().transpose(1, 2)                 # column-major per group
        return scaled_grouped_mm(a, b, _inv(self.g_rows, -1), _inv(self.w_cols, g, k), self.offsets,
                                 self.grad.dtype, self.spec.loop)

    def _per_row(self, scale: torch.Tensor) -> torch.Tensor:
        """(S, k) segment scales -> (n, k) each row's (ones past the last segment)."""
        return torch.cat([scale, scale.new_ones(1, scale.shape[1])]).index_select(0, self.seg)

    def wgrad(self) -> torch.Tensor:
        """dy_g^T x_g per group, segment by segment: (G, out, in) in the weight's dtype."""
        a = _quantize(self.grad, self._per_row(self.g_cols), self.spec.recipe.grad_dtype)  # (n, out)
        b = _quantize(self.x, self._per_row(self.x_cols), E4M3)                          # (n, in)
        return scaled_grouped_wgrad(a, b, _inv(self.g_cols, self.g_cols.shape),
                                    _inv(self.x_cols, self.x_cols.shape), self.segments,
                                    self.weight.shape[0], self.weight.dtype, self.spec.loop)


class _Fp8GroupedLinearForwardFp8GroupedLinearBackward(torch.autograd.Function):
    """y = x_g W_g^T per row group from float8 operands; backward both GEMMs in float8."""

    @staticmethod
    def forward(ctx, x, weight, offsets, segments, spec: GroupedFp8Spec):
        # x (n, in), weight (G, out, in), offsets (G,), segments (S,)
        ctx.save_for_backward(x, weight, offsets, segments)
        ctx.spec = spec
        return Fp8GroupedForward(spec, x, weight).linear(x, weight, offsets)  # (n, out)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        x, weight, offsets, segments = ctx.saved_tensors
        bw = Fp8GroupedBackward(ctx.spec, grad.contiguous(), x, weight, offsets, segments)
        grad_x = bw.dgrad() if ctx.needs_input_grad[0] else None          # (n, in)
        grad_w = bw.wgrad() if ctx.needs_input_grad[1] else None          # (G, out, in)
        return grad_x, grad_w, None, None, None


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                       spec: GroupedFp8Spec, bias: torch.Tensor | None = None,
                       segments: torch.Tensor | None = None,
                       groups: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_linear`` in FP8: (n, in) -> (n, out), the bias (G, out) added after the GEMM in
    the output's dtype; ``segments``: the weight gradient's row segments (None: the groups);
    ``groups`` (n,): each row's group when the caller has it (for the bias)."""
    _check(x, weight, offsets, bias)
    segments = offsets if segments is None else segments
    y = _Fp8GroupedLinearForwardFp8GroupedLinearBackward.apply(x.contiguous(), weight, offsets,
                                                                segments, spec)
    return add_group_bias(y, bias, offsets, groups)
