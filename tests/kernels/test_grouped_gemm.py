"""Grouped GEMM (kernels/grouped_gemm.py) against the loop, and the stacked experts against the
per-expert math.

- The loop reference against a per-row hand formula (each row times its group's weight).
- ``torch._grouped_mm`` (the CUDA path's code, which torch 2.13 runs on the CPU in fp32 and bf16):
  forward, the input, weight and bias gradients and the two backward helpers equal the loop on
  uneven and empty groups, with the offsets on the device and no host read at all (counted by the
  step's wait counter in strict mode); the loop reads the offsets once.
- The dispatch rules: unaligned rows, mixed dtypes, a device without the kernel take the loop.
- The NPU path through the stand-in (tests/helpers/npu_fake.py, which enforces the documented
  input rules of npu_grouped_matmul's one-tensor case: an int64 group list on the device), and
  the chip table's switch.
- The experts (models/moe/experts.py: one stacked parameter per projection, gate and up fused)
  equal each expert's own F.linear math (tests/helpers/moe_reference.py), outputs and the
  gradient of every logical tensor, GELU with biases and SwiGLU, uneven and empty segments, on
  each path; ``--no-moe-grouped-gemm`` (the loop over the same stacked weights) equals the
  grouped experts, and a whole MoE layer too.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from engine.device.syncs import SyncCounter
from kernels import (KernelPaths, grouped_input_grad, grouped_linear, grouped_linear_reference,
                     grouped_weight_grad)
from models.config import GPTConfig
from models.layers import LayerContext
from models.logical import logical_views
from models.moe.experts import LocalExperts
from models.moe.layer import MoELayer
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from tests.helpers.moe_reference import expert_forward
from tests.helpers.npu_fake import install_fake_npu

gg = importlib.import_module("kernels.grouped_gemm")
HAS_GROUPED_MM = gg.torch_grouped_mm_runs("cpu", torch.float32)
COUNTS = [[5, 0, 3, 8], [0, 4, 0], [7]]  # uneven, empty first/last/middle groups, one group


def _offsets(counts) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


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


def _grouped(x, w, counts, b, paths=None):
    return grouped_linear(x, w, _offsets(counts), b, paths)


def _assert_same(got, want, rtol=1e-6, atol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, i=i: f"item {i}: {m}")


def _waits(fn) -> list[str]:
    counter = SyncCounter(strict=True)
    with counter.step(), counter.watching():
        fn()
    return [e.name for e in counter.last]


def test_reference_is_each_row_times_its_groups_weight():
    for counts in COUNTS:
        x, w, b = _operands(counts)
        group = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (n,)
        want = torch.einsum("nk,nok->no", x, w[group]) + b[group]
        torch.testing.assert_close(grouped_linear_reference(x, w, counts, b), want)
        torch.testing.assert_close(gg.row_groups(_offsets(counts), sum(counts)), group)
    with pytest.raises(ValueError, match="offsets"):
        grouped_linear(x, w, torch.tensor([1, 2]), b)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no CPU torch._grouped_mm")
def test_grouped_mm_path_equals_the_loop_without_a_host_read():
    for counts in COUNTS:
        x, w, b = _operands(counts)
        assert gg.grouped_linear_path(x, w) == "torch"
        want = _run(grouped_linear_reference, x, w, b, counts)
        got = []
        assert _waits(lambda: got.extend(_run(_grouped, x, w, b, counts))) == []
        _assert_same(got, want)
        # the backward's helpers, as the zero-bubble split calls them
        dy = torch.randn(sum(counts), 8)
        torch.testing.assert_close(grouped_input_grad(dy, w.detach(), _offsets(counts)),
                                   torch.cat([g @ w.detach()[i] for i, g in
                                              enumerate(torch.split(dy, counts))]))
        dw = grouped_weight_grad(dy, x.detach(), _offsets(counts))
        for i, (g, xs) in enumerate(zip(torch.split(dy, counts), torch.split(x.detach(), counts))):
            torch.testing.assert_close(dw[i], g.t() @ xs)   # an empty group's is zero
        # bf16 through the same kernel: within bf16 rounding of the fp32 loop
        xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
        got = _run(_grouped, xb, wb, None, counts)
        want = _run(grouped_linear_reference, xb.float(), wb.float(), None, counts)
        _assert_same([t.float() for t in got], want, rtol=2e-2, atol=5e-2)


def test_dispatch_rules_and_the_loops_one_read():
    x, w, b = _operands([5, 0, 3, 8])
    xo, wo, _ = _operands([5, 0, 3, 8], k=6)                    # 24-byte rows: not aligned
    assert gg.grouped_linear_path(xo, wo) == "loop"
    assert gg.grouped_linear_path(x.bfloat16(), w) == "loop"   # mixed dtypes
    strided = torch.cat([x, x], 1)[:, :16]                     # rows 32 apart: not contiguous
    assert not strided.is_contiguous() and gg.grouped_linear_path(strided, w) == "loop"
    assert not gg.torch_grouped_mm_runs("cuda", torch.float32)  # not a dtype the CUDA path takes
    assert not gg.torch_grouped_mm_runs("cpu", torch.float16)
    counts = [5, 0, 3, 8]
    want = _run(grouped_linear_reference, xo, wo, None, counts)
    got = []
    assert _waits(lambda: got.extend(_run(_grouped, xo, wo, None, counts))) == ["tensor.tolist"]
    _assert_same(got, want)


def test_npu_path_through_the_stand_in_and_the_chip_switch(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    for counts in COUNTS:
        x, w, b = _operands(counts)
        fake.calls.clear()
        want = _run(grouped_linear_reference, x, w, b, counts)
        _assert_same(_run(_grouped, x, w, b, counts), want)
        assert fake.calls == ["npu_grouped_matmul"] * 2  # forward and the input gradient
    fake.calls.clear()
    grouped_linear(x, w, _offsets(counts), b, KernelPaths(grouped_matmul=False))
    assert fake.calls == []
    assert not gg.npu_grouped_matmul_fits(x.double(), w.double())
    assert not gg.npu_grouped_matmul_fits(x, torch.zeros(1025, 8, 16))   # over 1024 groups
    assert gg.npu_grouped_matmul_fits(x.bfloat16(), w.bfloat16())


# ---- the experts and the layer -------------------------------------------------------------------

H, FFN = 16, 8


def _config(grouped: bool = True, **extra) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=8, vocab_size=64,
                     seed=3, num_experts=4, moe_ffn_hidden_size=FFN, moe_grouped_gemm=grouped, **extra)


def _experts(kind, bias, grouped=True, paths=None):
    ctx = LayerContext(Initializer(3), **({} if paths is None else {"kernel_paths": paths}))
    return LocalExperts(_config(grouped), ctx, "layers.1.mlp.experts", kind, bias, range(4))


def _check_experts(counts, paths=None):
    for kind, bias in (("gelu", True), ("swiglu", False)):
        experts = _experts(kind, bias, paths=paths)
        x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(5)).requires_grad_()
        dy = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(6))
        experts(x, _offsets(counts)).backward(dy)
        # the reference: each expert's own F.linear math on its rows, on copies of its tensors
        ref = _experts(kind, bias, paths=paths)
        views = logical_views(ref)
        xr = x.detach().clone().requires_grad_()
        pieces = torch.split(xr, counts)
        y = torch.cat([expert_forward(ref, e, p) for e, p in enumerate(pieces)])
        y.backward(dy)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-6, atol=1e-6)
        # the reference's views carry their gradients into its stacked parameters
        for (n, mine), theirs in zip(experts.named_parameters(), ref.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, n=n: f"{kind} {n}: {m}")
        assert len(views) == 4 * (4 if bias else 3)


def test_experts_equal_the_per_expert_math():
    _check_experts([5, 0, 3, 8])
    _check_experts([0, 0, 6, 0])


def test_experts_equal_the_per_expert_math_on_the_npu_stand_in(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    _check_experts([5, 0, 3, 8])
    # per kind, forward and input gradient of each projection: gelu fc1, fc2; swiglu gate-up, fc2
    assert fake.calls.count("npu_grouped_matmul") == 2 * 2 * 2
    assert "npu_swiglu" in fake.calls  # the fused gate-up output is npu_swiglu's input as it is


def test_experts_hold_one_parameter_per_projection():
    gelu, swiglu = _experts("gelu", True), _experts("swiglu", False)
    assert {n: tuple(p.shape) for n, p in gelu.named_parameters()} == {
        "fc1_weight": (4, FFN, H), "fc2_weight": (4, H, FFN), "fc1_bias": (4, FFN), "fc2_bias": (4, H)}
    assert {n: tuple(p.shape) for n, p in swiglu.named_parameters()} == {
        "gate_up_weight": (4, 2 * FFN, H), "fc2_weight": (4, H, FFN)}
    assert sorted(logical_views(swiglu))[:3] == ["experts.0.fc2.weight", "experts.0.gate.weight",
                                                 "experts.0.up.weight"]
    assert all(getattr(p, "expert_parallel", False) for p in gelu.parameters())


def test_loop_mode_and_the_layer_equal_the_grouped_experts():
    """--no-moe-grouped-gemm (the loop over the same stacked weights) against the default, for
    the experts and for router, dispatch and experts together."""
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
