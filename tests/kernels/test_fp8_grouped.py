"""kernels/fp8_grouped.py: the experts' FP8 grouped GEMMs against their fp32 references.

On the CPU (torch 2.13 has no CPU ``torch._scaled_grouped_mm``) every group is one
``torch._scaled_mm``, torch's own CPU FP8 kernel, counted by a dispatch mode that only observes;
the reference dequantizes and multiplies in fp32, so each bf16 output element may differ from it by
one bf16 rounding (2^-8 relative, tests/kernels/test_fp8.py) plus fp32 reassociation. The layer's
Function is held to a reference written out here from the definitions (rowwise power-of-two scales
along each contraction, e4m3 operands, the gradient in the recipe's format, per-segment column
scales in the weight gradient). On the meta device, whose ``torch._scaled_grouped_mm`` checks are
CUDA's, the grouped kernel takes all three GEMMs under e4m3: its layout and scale rules hold.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.fp8 import E4M3, E5M2, Fp8Recipe, amax, amax_to_scale, quantize
from kernels.fp8_grouped import (GroupedFp8Spec, fp8_grouped_linear, fused_refusal, scaled_grouped_mm,
                                 scaled_grouped_mm_reference, scaled_grouped_wgrad,
                                 scaled_grouped_wgrad_reference)

BF16_ULP = 2.0 ** -8
COUNTS = [[5, 0, 19, 8], [0, 17, 0], [33]]    # uneven, empty first/middle/last groups, one group


class CountOps(TorchDispatchMode):
    """How many times each of ``names`` (aten overload packets) ran inside, and each call's
    ``use_fast_accum`` in order (``fast``); observes only."""

    def __init__(self, *names):
        super().__init__()
        self.calls = dict.fromkeys(names, 0)
        self.fast = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.calls:
            self.calls[name] += 1
            names = [arg.name for arg in func._schema.arguments]
            at = names.index("use_fast_accum")
            self.fast.append(bool(args[at] if len(args) > at else
                                  (kwargs or {}).get("use_fast_accum", False)))
        return func(*args, **(kwargs or {}))


def _offsets(counts, device="cpu") -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs()
    bound = BF16_ULP * want.float().abs() + 1e-6
    assert (err <= bound).all(), (err - bound).max()


def _pow2(a: torch.Tensor, dtype) -> torch.Tensor:
    return amax_to_scale(a, dtype, power_of_two=True)


@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_grouped_gemms_run_scaled_mm_per_group_and_match_the_reference(grad_dtype):
    gen = torch.Generator().manual_seed(0)
    for counts in COUNTS:
        n, g, k, out = sum(counts), len(counts), 32, 48
        offsets = _offsets(counts)
        x, dy = torch.randn(n, k, generator=gen) * 3, torch.randn(n, out, generator=gen)
        w = torch.randn(g, out, k, generator=gen) * 0.05
        sx, sw = _pow2(amax(x, -1), E4M3), _pow2(amax(w, -1), E4M3)
        a, b = quantize(x, sx, E4M3), quantize(w, sw, E4M3).transpose(1, 2)
        args = (a, b, sx.reciprocal().view(-1), sw.reciprocal().view(g, out))
        live = sum(c > 0 for c in counts)
        with CountOps("_scaled_mm", "_scaled_grouped_mm") as ops:
            got = scaled_grouped_mm(*args, offsets, torch.bfloat16)
        assert ops.calls == {"_scaled_mm": live, "_scaled_grouped_mm": 0}
        _close(got, scaled_grouped_mm_reference(*args, counts, torch.float32))
        # the input gradient: dy (grad format) first, W column-major per group second
        sg, swc = _pow2(amax(dy, -1), grad_dtype), _pow2(amax(w, 1), E4M3)
        a, b = quantize(dy, sg, grad_dtype), quantize(w, swc, E4M3)
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
        args = (a, b, sg.reciprocal().view(-1), swc.reciprocal().view(g, k))
        with CountOps("_scaled_mm") as ops:
            got = scaled_grouped_mm(*args, offsets, torch.bfloat16)
        assert ops.calls["_scaled_mm"] == live
        _close(got, scaled_grouped_mm_reference(*args, counts, torch.float32))


def test_weight_gradient_by_segments_pads_rows_and_leaves_out_the_tail():
    """Two segments per group (R = 2, some empty), row counts that are no multiple of 16 (each
    segment zero-padded to one: still torch._scaled_mm), rows past the last segment left out."""
    gen = torch.Generator().manual_seed(1)
    seg_counts = [3, 9, 0, 0, 21, 1]      # groups of (3, 9), (0, 0), (21, 1)
    n, out, k = sum(seg_counts) + 4, 48, 32   # 4 trailing rows in no segment
    segments = _offsets(seg_counts)
    dy, x = torch.randn(n, out, generator=gen), torch.randn(n, k, generator=gen)
    s = len(seg_counts)
    sg = torch.rand(s, out, generator=gen) + 0.5
    sx = torch.rand(s, k, generator=gen) + 0.5
    a, b = dy.to(E5M2), x.to(E4M3)
    with CountOps("_scaled_mm") as ops:
        got = scaled_grouped_wgrad(a, b, sg, sx, segments, 3, torch.bfloat16)
    assert ops.calls["_scaled_mm"] == 4 and got.shape == (3, out, k)
    want = scaled_grouped_wgrad_reference(a, b, sg, sx, seg_counts, 3, torch.float32)
    # each segment rounds to bf16 before the fp32 sum of a group's segments: the bound is one
    # rounding of each segment's product and one of the sum
    ends = segments.tolist()
    parts = torch.zeros(3, out, k)
    for i, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        parts[i // 2] += ((a[lo:hi].float() * sg[i]).t() @ (b[lo:hi].float() * sx[i])).abs()
    err = (got.float() - want).abs()
    assert (err <= BF16_ULP * (parts + want.abs()) + 1e-6).all()
    assert torch.equal(got[1], torch.zeros(out, k, dtype=torch.bfloat16))
    cut = scaled_grouped_wgrad_reference(a[:-4], b[:-4], sg, sx, seg_counts, 3, torch.float32)
    assert torch.equal(want, cut)  # the tail rows are in no product


def _reference_linear(x, w, dy, counts, seg_counts, grad_dtype):
    """y, dx, dW by the definitions, in fp32 from the dequantized operands, and the sum of the
    magnitudes of each group's segment products (a segment rounds to bf16 before their sum)."""
    def deq(t, s, dtype):
        return quantize(t, s, dtype).float() / s

    starts = torch.cumsum(torch.tensor([0] + counts[:-1]), 0).tolist()
    x_q = deq(x, _pow2(amax(x, -1), E4M3), E4M3)
    w_rows, w_cols = deq(w, _pow2(amax(w, -1), E4M3), E4M3), deq(w, _pow2(amax(w, 1), E4M3), E4M3)
    dy_q = deq(dy, _pow2(amax(dy, -1), grad_dtype), grad_dtype)
    y = torch.cat([x_q[s:s + c] @ w_rows[g].t() for g, (s, c) in enumerate(zip(starts, counts))])
    dx = torch.cat([dy_q[s:s + c] @ w_cols[g] for g, (s, c) in enumerate(zip(starts, counts))])
    r = len(seg_counts) // len(counts)
    dw, parts, at = torch.zeros(w.shape), torch.zeros(w.shape), 0
    for i, c in enumerate(seg_counts):
        rows = slice(at, at + c)
        if c:
            gs, xs = dy[rows], x[rows]
            ga, xa = _pow2(amax(gs, 0).view(1, -1), grad_dtype), _pow2(amax(xs, 0).view(1, -1), E4M3)
            product = deq(gs, ga, grad_dtype).t() @ deq(xs, xa, E4M3)
            dw[i // r] += product
            parts[i // r] += product.abs()
        at += c
    return y, dx, dw, parts


@pytest.mark.parametrize("fmt,k", [("e4m3", 32), ("hybrid", 32), ("hybrid", 40)],
                         ids=["e4m3", "hybrid", "hybrid-odd-width"])
def test_fp8_grouped_linear_forward_and_both_gradients(fmt, k):
    """The autograd Function against the definitions, with two segments per group; at an odd
    width (in = 40, no multiple of 16) the forward and the input gradient fall back to the
    reference as ``scaled_mm`` does, the weight gradient (K = rows, padded; N = 40) too."""
    gen = torch.Generator().manual_seed(2)
    counts, seg_counts = [12, 0, 21], [5, 7, 0, 0, 21, 0]
    n, g, out = sum(counts), len(counts), 48
    x = (torch.randn(n, k, generator=gen) * 2).to(torch.bfloat16)
    w = (torch.randn(g, out, k, generator=gen) * 0.05).to(torch.bfloat16)
    dy = torch.randn(n, out, generator=gen).to(torch.bfloat16)
    spec = GroupedFp8Spec(Fp8Recipe(fmt, "tensorwise"))   # the experts' scales are rowwise anyway
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with CountOps("_scaled_mm") as ops:
        y = fp8_grouped_linear(xl, wl, _offsets(counts), spec, segments=_offsets(seg_counts))
        y.backward(dy)
    # forward and input gradient: one GEMM per non-empty group (2 each); the weight gradient one
    # per non-empty segment (3); none at the odd width
    assert ops.calls["_scaled_mm"] == (0 if k % 16 else 2 + 2 + 3)
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    *want, parts = _reference_linear(x.float(), w.float(), dy.float(), counts, seg_counts, grad_dtype)
    for got, ref, what in zip((y, xl.grad, wl.grad), want, ("y", "dx", "dW")):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape, what
        bound = BF16_ULP * (ref.abs() + (parts if what == "dW" else 0)) + 1e-6
        assert ((got.float() - ref).abs() <= bound).all(), what
    # FP8 is not bf16: the same GEMM without quantization is measurably another result
    plain = torch.cat([a.float() @ w[i].float().t() for i, a in enumerate(torch.split(x, counts))])
    assert (y.float() - plain).abs().max() > 1e-2


def test_empty_input_and_bias():
    spec = GroupedFp8Spec(Fp8Recipe("hybrid"))
    w = torch.randn(3, 16, 32).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(3, 16).to(torch.bfloat16).requires_grad_()
    x = torch.zeros(0, 32, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_grouped_linear(x, w, _offsets([0, 0, 0]), spec, bias)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(bias.grad, torch.zeros_like(bias))


def test_the_grouped_kernel_takes_all_three_gemms_under_e4m3_on_meta():
    """The meta device runs torch._scaled_grouped_mm's CUDA checks (layouts, e4m3 operands,
    scale shapes, int32 offsets, bf16 out): under e4m3 all three GEMMs pass them; under hybrid
    the e5m2 gradient is refused there, so the backward takes the loop (on the CPU as on CUDA)."""
    spec = GroupedFp8Spec(Fp8Recipe("e4m3"))
    x = torch.empty(40, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(3, 48, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.empty(3, device="meta", dtype=torch.int32)
    segments = torch.empty(6, device="meta", dtype=torch.int32)
    with CountOps("_scaled_mm", "_scaled_grouped_mm") as ops:
        y = fp8_grouped_linear(x, w, offsets, spec, segments=segments)
        y.backward(torch.empty_like(y))
    assert ops.calls == {"_scaled_mm": 0, "_scaled_grouped_mm": 3}
    assert ops.fast == [True, False, False]   # fast accumulation in the forward GEMM only
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and w.grad.dtype == torch.bfloat16
    a = torch.empty(8, 48, device="meta", dtype=E5M2)
    assert "e4m3" in fused_refusal(a, a.to(E4M3), 48, 32, torch.bfloat16)
    assert fused_refusal(a.to(E4M3), a.to(E4M3), 48, 40, torch.bfloat16) is not None
    cpu = torch.zeros(8, 48, dtype=E4M3)
    assert "device" in fused_refusal(cpu, cpu, 48, 32, torch.bfloat16)


def test_a_thousand_groups_or_more_take_the_loop():
    """sm90's grouped kernel refuses 1024 groups or more ("Can't process more than 1024 groups"),
    which the meta device does not check: the rule is the engine's, and such a GEMM loops."""
    e4 = torch.empty(8, 48, device="meta", dtype=E4M3)
    assert fused_refusal(e4, e4, 48, 32, torch.bfloat16, groups=1023) is None
    assert "fewer than 1024 groups" in fused_refusal(e4, e4, 48, 32, torch.bfloat16, groups=1024)
    # a weight gradient of 64 experts x 16 sources: 1024 segments, per-segment scaled_mm calls
    g, r, rows = 64, 16, 2
    a = torch.randn(g * r * rows, 32).to(E4M3)
    b = torch.randn(g * r * rows, 16).to(E4M3)
    segments = torch.arange(1, g * r + 1, dtype=torch.int32) * rows
    sa, sb = torch.ones(g * r, 32), torch.ones(g * r, 16)
    with mock.patch("kernels.fp8_grouped.scaled_grouped_mm_runs", return_value=True), \
            CountOps("_scaled_mm", "_scaled_grouped_mm") as ops:
        got = scaled_grouped_wgrad(a, b, sa, sb, segments, g, torch.bfloat16)
    assert ops.calls == {"_scaled_mm": g * r, "_scaled_grouped_mm": 0}
    assert torch.equal(got, scaled_grouped_wgrad(a, b, sa, sb, segments, g, torch.bfloat16,
                                                 loop=True))   # what --no-moe-grouped-gemm runs


class RecordingGroup:
    """A stand-in CommGroup of two ranks whose MAX all-reduce doubles nothing and records the
    size of each reduction (single process: the peer's values equal this rank's)."""

    def __init__(self, kind: str):
        self.kind, self.size, self.sizes = kind, 2, []

    def all_reduce(self, t: torch.Tensor, op=None) -> None:
        self.sizes.append(t.numel())


def test_one_reduction_per_group_and_pass_with_the_sizes_the_planner_counts():
    """fc2 under ETP (input features sharded): forward one all-reduce of n per-row amaxes and G out
    weight-row amaxes; fc1 (output features sharded): backward n + G in; the weight gradient's
    segment columns over the token group: S (out + in)."""
    counts, seg_counts = [7, 9], [3, 4, 9, 0]
    n, g, s, k, out = 16, 2, 4, 32, 48
    x = torch.randn(n, k).to(torch.bfloat16).requires_grad_()
    w = torch.randn(g, out, k).to(torch.bfloat16).requires_grad_()
    for sharded in ("in", "out"):
        etp, tokens = RecordingGroup("tp"), RecordingGroup("cp")
        groups = {"in_groups" if sharded == "in" else "out_groups": (etp,), "token_groups": (tokens,)}
        spec = GroupedFp8Spec(Fp8Recipe("hybrid"), **groups)
        y = fp8_grouped_linear(x, w, _offsets(counts), spec, segments=_offsets(seg_counts))
        forward = list(etp.sizes)
        y.sum().backward()
        assert tokens.sizes == [s * (out + k)]
        if sharded == "in":
            assert forward == [n + g * out] and etp.sizes == forward
        else:
            assert forward == [] and etp.sizes == [n + g * k]
