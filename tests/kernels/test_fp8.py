"""kernels/fp8.py: quantization, scales, and torch._scaled_mm against the fp32 reference.

The GEMMs are torch 2.13's own CPU kernel (counted: the real op runs, no stand-in); the reference
multiplies the dequantized operands in fp32, so a scaled GEMM in bf16 may differ from it by the
bf16 rounding of its output only: one unit in the last place of bf16, 2^-8 of each element (the
CPU kernel rounds twice: the product, then the scaled or biased result; measured 2^-8.05), plus
fp32 reassociation. The rules (layouts, widths, dtypes) are CUDA's, applied on the CPU too.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.fp8 import (E4M3, E5M2, Fp8Recipe, amax, amax_to_scale, dequantize, fp8_max, quantize,
                         scaled_grouped_mm_runs, scaled_mm, scaled_mm_reference, scaled_mm_rules)

BF16_ULP = 2.0 ** -8


class CountScaledMM(TorchDispatchMode):
    """How many aten._scaled_mm calls ran inside (observes, changes nothing)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _operands(m, k, n, a_dtype, b_dtype, rowwise, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    if rowwise:
        sa = amax_to_scale(amax(x, -1), a_dtype, True)            # (m, 1)
        sb = amax_to_scale(amax(w, -1), b_dtype, True)            # (n, 1)
    else:
        sa, sb = amax_to_scale(amax(x), a_dtype), amax_to_scale(amax(w), b_dtype)
    a, b = quantize(x, sa, a_dtype), quantize(w, sb, b_dtype).t()  # (m, k) row-, (k, n) col-major
    inv_a = sa.reciprocal() if not rowwise else sa.reciprocal().reshape(-1, 1)
    inv_b = sb.reciprocal() if not rowwise else sb.reciprocal().reshape(1, -1)
    return a, b, inv_a, inv_b


@pytest.mark.parametrize("rowwise,a_dtype,b_dtype", [
    (False, E4M3, E4M3), (False, E5M2, E4M3), (False, E4M3, E5M2),
    (True, E4M3, E4M3), (True, E5M2, E4M3)],   # rowwise: b e4m3 only (a rule, tested below)
    ids=["tensorwise-e4m3xe4m3", "tensorwise-e5m2xe4m3", "tensorwise-e4m3xe5m2",
         "rowwise-e4m3xe4m3", "rowwise-e5m2xe4m3"])
def test_scaled_mm_runs_torch_and_matches_the_reference(rowwise, a_dtype, b_dtype):
    a, b, inv_a, inv_b = _operands(48, 64, 32, a_dtype, b_dtype, rowwise)
    bias = torch.randn(32).to(torch.bfloat16)
    with CountScaledMM() as counter:
        got = scaled_mm(a, b, inv_a, inv_b, torch.bfloat16, bias)
    assert counter.calls == 1
    want = scaled_mm_reference(a, b, inv_a, inv_b, torch.float32, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (48, 32)
    err = (got.float() - want).abs()
    assert (err <= BF16_ULP * want.abs() + 1e-6).all(), err.max()
    # the scales matter: the same bytes without them are another result
    plain = scaled_mm_reference(a, b, torch.tensor(1.0), torch.tensor(1.0), torch.float32)
    assert not torch.allclose(plain, want, rtol=1e-2)


@pytest.mark.parametrize("case,why", [
    ("odd_k", "multiples of 16"), ("row_major_b", "column-major"), ("col_major_a", "row-major"),
    ("e5m2_both", "e5m2 x e5m2"), ("rowwise_e5m2_b", "b must be e4m3")])
def test_rules_send_what_cuda_refuses_to_the_reference(case, why):
    rowwise = case.startswith("rowwise")
    a_dt = E5M2 if case == "e5m2_both" else E4M3
    b_dt = E5M2 if case in ("e5m2_both", "rowwise_e5m2_b") else E4M3
    k = 40 if case == "odd_k" else 64
    a, b, inv_a, inv_b = _operands(32, k, 48, a_dt, b_dt, rowwise)
    if case == "row_major_b":
        b = b.contiguous()
    if case == "col_major_a":
        a = a.t().contiguous().t()
    assert why in scaled_mm_rules(a, b, inv_a, inv_b)
    with CountScaledMM() as counter:
        got = scaled_mm(a, b, inv_a, inv_b, torch.bfloat16)
    assert counter.calls == 0
    assert torch.equal(got, scaled_mm_reference(a, b, inv_a, inv_b, torch.bfloat16))


@pytest.mark.parametrize("out_dtype,bias_dtype,why", [
    (torch.float32, torch.bfloat16, "fp32 output"), (torch.bfloat16, torch.float32, "the bias must"),
    (torch.float16, torch.bfloat16, "the bias must")])
def test_a_bias_cuda_refuses_is_added_after_the_gemm(out_dtype, bias_dtype, why):
    """ScaledBlas.cpp: no bias with an fp32 output, and a bias in the output's dtype (bf16 or
    fp16); the CPU kernel takes either. Such a bias is added after torch._scaled_mm, which still
    runs (its one call, without the bias), instead of failing on CUDA."""
    a, b, inv_a, inv_b = _operands(48, 64, 32, E4M3, E4M3, False)
    bias = torch.randn(32).to(bias_dtype)
    assert why in scaled_mm_rules(a, b, inv_a, inv_b, out_dtype, bias)
    assert scaled_mm_rules(a, b, inv_a, inv_b, out_dtype) is None
    biases = []

    class SeeBias(CountScaledMM):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_mm.default:
                biases.append(args[4] if len(args) > 4 else (kwargs or {}).get("bias"))
            return super().__torch_dispatch__(func, types, args, kwargs)

    with SeeBias() as counter:
        got = scaled_mm(a, b, inv_a, inv_b, out_dtype, bias)
    assert counter.calls == 1 and biases == [None]
    want = scaled_mm_reference(a, b, inv_a, inv_b, torch.float32, bias)
    product = scaled_mm_reference(a, b, inv_a, inv_b, torch.float32)
    # three roundings at most: the product, the bias, their sum (each half an ulp, fp16's finer)
    bound = BF16_ULP * (product.abs() + bias.float().abs() + want.abs()) + 1e-6
    assert got.dtype == out_dtype and ((got.float() - want).abs() <= bound).all()
    # rowwise writes bf16 only: an fp32 output of a rowwise GEMM runs the reference
    a, b, inv_a, inv_b = _operands(48, 64, 32, E4M3, E4M3, True)
    assert "bf16" in scaled_mm_rules(a, b, inv_a, inv_b, torch.float32)
    with CountScaledMM() as counter:
        got = scaled_mm(a, b, inv_a, inv_b, torch.float32)
    assert counter.calls == 0 and torch.equal(got, scaled_mm_reference(a, b, inv_a, inv_b,
                                                                         torch.float32))


def test_quantize_rounds_to_the_nearest_step_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1, -3.3, 447.0, 500.0, -1e6])
    q = quantize(x, torch.tensor(1.0), E4M3)
    # e4m3: 3 mantissa bits, steps of 1/8 in [1, 2); 1.0625 is a tie (to even: 1.0); 448 the max
    assert dequantize(q, torch.tensor(1.0)).tolist() == [0.0, 1.0, 1.0, 1.125, -3.25, 448.0, 448.0,
                                                        -448.0]
    assert quantize(torch.tensor([1e6]), torch.tensor(1.0), E5M2).float().item() == 57344.0
    # with a scale: x * s is what is rounded; dequantization divides it out again
    s = amax_to_scale(torch.tensor(2.0), E4M3)
    assert s.item() == 224.0 and dequantize(quantize(torch.tensor([2.0, -1.0]), s, E4M3), s).tolist() == [2.0, -1.0]


def test_scales_are_max_over_amax_and_rowwise_powers_of_two():
    a = torch.tensor([3.0, 0.0, 1e-20])
    s = amax_to_scale(a, E4M3)
    assert s[0].item() == pytest.approx(448 / 3) and s[1].item() == pytest.approx(448 / 1e-12, rel=1e-6)
    p = amax_to_scale(a, E5M2, power_of_two=True)
    assert p[0].item() == 16384.0          # 57344 / 3 = 19114.7 rounded down to 2^14
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    x = torch.randn(4, 5, 6).to(torch.bfloat16)
    assert amax(x).item() == x.float().abs().max().item()
    assert torch.equal(amax(x, -1), x.float().abs().amax(-1, keepdim=True))


def test_recipes_name_megatrons_formats():
    assert Fp8Recipe("hybrid").grad_dtype == E5M2 and Fp8Recipe("e4m3").grad_dtype == E4M3
    assert Fp8Recipe("hybrid", "rowwise").power_of_two and not Fp8Recipe().power_of_two
    with pytest.raises(ValueError, match="--fp8-format"):
        Fp8Recipe("e5m2")
    with pytest.raises(ValueError, match="--fp8-recipe"):
        Fp8Recipe("hybrid", "blockwise")


def test_compiled_quantize_is_the_eager_expression():
    """The CUDA path's compiled expression, run by inductor's CPU backend: the same bytes."""
    x = torch.randn(2, 48, 64).to(torch.bfloat16) * 7
    for scale in (amax_to_scale(amax(x), E4M3), amax_to_scale(amax(x, -1), E5M2, True)):
        dtype = E4M3 if scale.dim() == 0 else E5M2
        eager = quantize(x, scale, dtype, compiled=False)
        compiled = quantize(x, scale, dtype, compiled=True)
        assert torch.equal(eager.view(torch.uint8), compiled.view(torch.uint8))


def test_scaled_grouped_mm_probe():
    """torch 2.13 registers _scaled_grouped_mm for CUDA only: on the CPU the experts run one
    torch._scaled_mm per group (kernels/fp8_grouped.py); the meta device (dry runs) accepts it."""
    assert hasattr(torch, "_scaled_grouped_mm")
    assert scaled_grouped_mm_runs("cpu") is False
    assert scaled_grouped_mm_runs("meta") is True
