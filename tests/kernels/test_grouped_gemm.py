"""Grouped GEMM (kernels/grouped_gemm.py) against the loop, and the experts with --moe-grouped-gemm
against the experts' loop.

- The loop reference against a per-row hand formula (each row times its group's weight).
- The CUDA path's code on this CPU: torch 2.13 has a CPU ``torch._grouped_mm`` (fp32 and bf16,
  16-byte aligned strides), so ``torch_grouped_linear`` runs for real, forward and backward, on
  uneven and empty groups; the dispatch (device kind forced to "cuda") takes it only in the
  allowed dtypes with aligned strides, the loop otherwise.
- The NPU path through the stand-in (tests/helpers/npu_fake.py, which enforces the documented
  input rules of npu_grouped_matmul's one-tensor case), and the chip table's switch.
- The experts (models/moe/experts.py) and a whole MoE layer with grouped GEMM equal the loop,
  outputs and every gradient, gelu experts with biases and swiglu experts without, with uneven
  and empty expert segments, on each path; the parameter names do not change.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from kernels import KernelPaths, grouped_linear, grouped_linear_reference
from models.config import GPTConfig
from models.layers import LayerContext
from models.moe.experts import LocalExperts
from models.moe.layer import MoELayer
from parallel.state import ParallelState
from parallel.tensor_parallel import Initializer
from tests.helpers.npu_fake import install_fake_npu

gg = importlib.import_module("kernels.grouped_gemm")
HAS_GROUPED_MM = gg.torch_grouped_mm_runs("cpu")
COUNTS = [[5, 0, 3, 8], [0, 4, 0], [7]]  # uneven, empty first/last/middle groups, one group


def _operands(counts, k=16, out=8, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = len(counts)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(g, out, k, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(g, out, generator=gen).to(dtype).requires_grad_() if bias else None
    return x, w, b


def _run(fn, x, w, b, counts, seed=1):
    """Output and the gradients of x, w, b for a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = fn(leaves[0], leaves[1], counts, leaves[2] if b is not None else None)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def _assert_same(got, want, rtol=1e-6, atol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, i=i: f"item {i}: {m}")


def test_reference_is_each_row_times_its_groups_weight():
    for counts in COUNTS:
        x, w, b = _operands(counts)
        group = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (n,)
        want = torch.einsum("nk,nok->no", x, w[group]) + b[group]
        torch.testing.assert_close(grouped_linear_reference(x, w, counts, b), want)
    with pytest.raises(ValueError, match="counts"):
        grouped_linear_reference(x, w, [1, 2], b)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
def test_torch_grouped_mm_path_equals_the_loop_on_cpu():
    for counts in COUNTS:
        x, w, _ = _operands(counts, bias=False)
        got = _run(lambda x, w, c, b: gg.torch_grouped_linear(x, w, c), x, w, None, counts)
        _assert_same(got, _run(grouped_linear_reference, x, w, None, counts))
        # bf16 through the same kernel: within bf16 rounding of the fp32 loop
        xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
        got = _run(lambda x, w, c, b: gg.torch_grouped_linear(x, w, c), xb, wb, None, counts)
        want = _run(grouped_linear_reference, xb.float(), wb.float(), None, counts)
        _assert_same([t.float() for t in got], want, rtol=2e-2, atol=5e-2)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
def test_cuda_dispatch_takes_grouped_mm_only_where_its_rules_hold(monkeypatch):
    monkeypatch.setattr(gg, "device_kind", lambda t: "cuda")
    x, w, b = _operands([5, 0, 3, 8])
    assert gg.grouped_linear_path(x, w) == "loop"              # fp32 is not a CUDA dtype
    assert gg.grouped_linear_path(x.bfloat16(), w.bfloat16()) == "torch"
    xo, wo, _ = _operands([5, 0, 3, 8], k=6)                    # 12-byte rows: not aligned
    assert gg.grouped_linear_path(xo.bfloat16(), wo.bfloat16()) == "loop"
    assert gg.grouped_linear_path(x.bfloat16(), w) == "loop"   # mixed dtypes
    strided = torch.cat([x, x], 1).bfloat16()[:, :16]          # rows 32 apart: not contiguous
    assert not strided.is_contiguous() and gg.grouped_linear_path(strided, w.bfloat16()) == "loop"
    assert gg.grouped_linear_path(x[:0].bfloat16(), w.bfloat16()) == "loop"  # no rows
    monkeypatch.setattr(gg, "TORCH_GROUPED_MM_DTYPES", (torch.float32,))
    calls = []
    real = gg.torch_grouped_linear
    monkeypatch.setattr(gg, "torch_grouped_linear", lambda *a: calls.append(1) or real(*a))
    for counts in COUNTS:
        x, w, b = _operands(counts)
        want = _run(grouped_linear_reference, x, w, b, counts)
        _assert_same(_run(grouped_linear, x, w, b, counts), want)
    assert len(calls) == len(COUNTS)


def test_npu_path_through_the_stand_in_and_the_chip_switch(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    for counts in COUNTS:
        x, w, b = _operands(counts)
        fake.calls.clear()
        want = _run(grouped_linear_reference, x, w, b, counts)
        _assert_same(_run(grouped_linear, x, w, b, counts), want)
        assert fake.calls == ["npu_grouped_matmul"] * 2  # forward and the input gradient
    fake.calls.clear()
    grouped_linear(x, w, counts, b, KernelPaths(grouped_matmul=False))
    assert fake.calls == []
    assert not gg.npu_grouped_matmul_fits(x.double(), w.double())
    assert not gg.npu_grouped_matmul_fits(x, torch.zeros(1025, 8, 16))   # over 1024 groups
    assert gg.npu_grouped_matmul_fits(x.bfloat16(), w.bfloat16())


# ---- the experts and the layer -------------------------------------------------------------------

H, FFN = 16, 8


def _config(grouped: bool, **extra) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=8, vocab_size=64,
                     seed=3, num_experts=4, moe_ffn_hidden_size=FFN, moe_grouped_gemm=grouped, **extra)


def _experts_run(grouped: bool, kind: str, bias: bool, counts, paths=None):
    ctx = LayerContext(Initializer(3), **({} if paths is None else {"kernel_paths": paths}))
    experts = LocalExperts(_config(grouped), ctx, "layers.1.mlp.experts", kind, bias, range(4))
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(5)).requires_grad_()
    y = experts(x, counts)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(6)))
    grads = {n: p.grad for n, p in experts.named_parameters()}
    return y.detach(), x.grad, grads


def _check_experts(counts, paths=None):
    for kind, bias in (("gelu", True), ("swiglu", False)):
        got = _experts_run(True, kind, bias, counts, paths)
        want = _experts_run(False, kind, bias, counts, paths)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        assert got[2].keys() == want[2].keys()  # the same parameter names in both modes
        for n, g in want[2].items():
            torch.testing.assert_close(got[2][n], g, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, n=n: f"{kind} {n}: {m}")
        assert any(n.startswith("experts.1.") for n in want[2])


def test_experts_grouped_equal_the_loop_on_cpu():
    _check_experts([5, 0, 3, 8])
    _check_experts([0, 0, 6, 0])


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
def test_experts_grouped_equal_the_loop_through_grouped_mm(monkeypatch):
    monkeypatch.setattr(gg, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(gg, "TORCH_GROUPED_MM_DTYPES", (torch.float32,))
    calls = []
    real = gg.torch_grouped_linear
    monkeypatch.setattr(gg, "torch_grouped_linear", lambda *a: calls.append(1) or real(*a))
    _check_experts([5, 0, 3, 8])
    assert len(calls) == 2 + 3  # gelu: fc1, fc2; swiglu: gate, up, fc2


def test_experts_grouped_equal_the_loop_on_the_npu_stand_in(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    _check_experts([5, 0, 3, 8])
    assert fake.calls.count("npu_grouped_matmul") == 2 * (2 + 3)  # forward and input gradient


def test_moe_layer_grouped_equals_the_loop():
    """Router, dispatch and experts together: the same outputs and gradients either way."""
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(7))
    for kind, bias in (("gelu", True), ("swiglu", False)):
        results = []
        for grouped in (False, True):
            cfg = _config(grouped, moe_router_topk=2, moe_aux_loss_coeff=0.01)
            layer = MoELayer(cfg, ParallelState.serial(), LayerContext(Initializer(3)),
                             "layers.1.mlp", kind=kind, bias=bias)
            xi = x.clone().requires_grad_()
            layer(xi).square().sum().backward()
            results.append((xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
        assert results[1][1].keys() == results[0][1].keys()
        for n, g in results[0][1].items():
            torch.testing.assert_close(results[1][1][n], g, rtol=1e-6, atol=1e-6)
