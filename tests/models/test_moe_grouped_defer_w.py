"""The stacked grouped-GEMM experts under the B/W split of the zero-bubble schedules
(models/moe/grouped_split.py): with a capturing ``WeightGradStore`` attached, the B (autograd's
backward) leaves every stacked expert weight and bias without a gradient and gives the input
gradient of the plain run; the store then holds one closure per projection, and its W gives the
gradients of the same experts without a store, grouped and looped (``--no-moe-grouped-gemm``),
fp32, tight tolerance. Covered: gelu experts with biases (gpt2) and swiglu experts without
(llama), an expert with no tokens (a zero block, as the loop gives it), ETP (0, 1) and both ranks
of ETP 2 (the fc2 bias on ETP rank 0 only), accumulation into a reducer's ``main_grad`` (one add
per projection) with ``on_ready`` told once per parameter, a store that is attached but not
capturing (the gradients in B), and the forward, B and W through ``torch._grouped_mm`` (this CPU's,
the CUDA path's code) and the NPU stand-in.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from models.config import GPTConfig
from models.layers import LayerContext
from models.moe.experts import LocalExperts
from models.logical import logical_views
from parallel.tensor_parallel import Initializer
from parallel.grads.weight_grad import WeightGradStore, attach_weight_grad_store
from tests.helpers.npu_fake import install_fake_npu

gg = importlib.import_module("kernels.grouped_gemm")
H, FFN = 16, 8
COUNTS = [5, 0, 3, 8]                                    # expert 1 gets no tokens
KINDS = [("gelu", True), ("swiglu", False)]              # gpt2 and llama experts
ETPS = [(0, 1), (0, 2), (1, 2)]


def _experts(grouped: bool, kind: str, bias: bool, etp) -> LocalExperts:
    cfg = GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=8,
                    vocab_size=64, seed=3, num_experts=4, moe_ffn_hidden_size=FFN,
                    moe_grouped_gemm=grouped)
    return LocalExperts(cfg, LayerContext(Initializer(3)), "layers.1.mlp.experts", kind, bias,
                        range(4), etp)


OFFSETS = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)


def _inputs():
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(6))
    return x, dy


def _plain(grouped: bool, kind: str, bias: bool, etp):
    """Output, input gradient and parameter gradients without a store."""
    experts = _experts(grouped, kind, bias, etp)
    x, dy = _inputs()
    x.requires_grad_()
    y = experts(x, OFFSETS)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("etp", ETPS)
@pytest.mark.parametrize("kind,bias", KINDS)
def test_grouped_expert_weight_gradients_wait_for_w(kind, bias, etp):
    grouped_ref = _plain(True, kind, bias, etp)
    looped_ref = _plain(False, kind, bias, etp)
    experts, store = _experts(True, kind, bias, etp), WeightGradStore()
    assert attach_weight_grad_store(experts, store) == 1  # the experts module holds it
    x, dy = _inputs()
    x.requires_grad_()
    with store.capture("b"):
        y = experts(x, OFFSETS)
        y.backward(dy)
    _close(y.detach(), grouped_ref[0], "output")
    _close(x.grad, grouped_ref[1], "input gradient")
    params = dict(experts.named_parameters())
    assert all(p.grad is None for p in params.values()), "B computed an expert weight gradient"
    assert store.run("b") == 2  # one closure per projection (gate and up are one), every expert in it
    for ref, mode in ((grouped_ref, "grouped"), (looped_ref, "looped")):
        assert ref[2].keys() == params.keys()
        for n, want in ref[2].items():
            if want is None:  # fc2's bias off ETP rank 0: never used, no gradient either way
                assert params[n].grad is None and n == "fc2_bias" and etp[0] != 0, n
                continue
            _close(params[n].grad, want, f"{mode} {n}")
    # each expert's block: expert 1 (no tokens) all zero, expert 0 not
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    holder = LocalExperts.__new__(LocalExperts)
    torch.nn.Module.__init__(holder)
    for n, g in grads.items():
        holder.register_parameter(n, torch.nn.Parameter(g, requires_grad=False))
        getattr(holder, n).logical_parts = params[n].logical_parts
    blocks = logical_views(holder)
    assert all(not t.any() for n, t in blocks.items() if n.startswith("experts.1."))
    assert any(t.abs().sum() > 0 for n, t in blocks.items() if n.startswith("experts.0."))


def test_w_accumulates_into_main_grad_and_tells_every_parameter():
    """The reducer's way: W adds into fp32 ``main_grad`` (twice: two micro-batches) and calls
    ``on_ready`` once per parameter per W, the expert without tokens included."""
    _, _, want = _plain(True, "gelu", True, (0, 1))
    experts = _experts(True, "gelu", True, (0, 1))
    told: list = []
    store = WeightGradStore(on_ready=told.append)
    attach_weight_grad_store(experts, store)
    params = list(experts.parameters())
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    for micro in range(2):
        x, dy = _inputs()
        with store.capture(micro):
            experts(x.requires_grad_(), OFFSETS).backward(dy)
    assert all(p.grad is None for p in params)
    assert all(not p.main_grad.any() for p in params)
    adds = []
    real_add = torch.Tensor.add_
    for micro in range(2):
        torch.Tensor.add_ = lambda self, *a, **k: adds.append(1) or real_add(self, *a, **k)
        try:
            store.run(micro)
        finally:
            torch.Tensor.add_ = real_add
    assert len(adds) == 2 * len(params)  # one add into main_grad per stacked parameter and W
    assert len(told) == 2 * len(params) and {id(p) for p in told} == {id(p) for p in params}
    for n, p in experts.named_parameters():
        _close(p.main_grad, 2 * want[n], n)


def test_attached_store_not_capturing_computes_the_gradients_in_b():
    for kind, bias in KINDS:
        _, grad_x, want = _plain(True, kind, bias, (0, 1))
        experts = _experts(True, kind, bias, (0, 1))
        attach_weight_grad_store(experts, WeightGradStore())
        x, dy = _inputs()
        x.requires_grad_()
        experts(x, OFFSETS).backward(dy)
        _close(x.grad, grad_x, "input gradient")
        for n, p in experts.named_parameters():
            _close(p.grad, want[n], n)


def _split_run(kind: str, bias: bool):
    experts, store = _experts(True, kind, bias, (0, 1)), WeightGradStore()
    attach_weight_grad_store(experts, store)
    x, dy = _inputs()
    x.requires_grad_()
    with store.capture("b"):
        y = experts(x, OFFSETS)
        y.backward(dy)
    store.run("b")
    return y.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}


def _check_split_equals_plain():
    for kind, bias in KINDS:
        got, want = _split_run(kind, bias), _plain(False, kind, bias, (0, 1))
        _close(got[0], want[0], "output")
        _close(got[1], want[1], "input gradient")
        for n, g in want[2].items():
            _close(got[2][n], g, n)


@pytest.mark.skipif(not gg.torch_grouped_mm_runs("cpu", torch.float32),
                    reason="no CPU torch._grouped_mm")
def test_split_keeps_the_grouped_mm_path(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    _check_split_equals_plain()
    # per kind and projection: forward, input gradient (B) and weight gradient (W)
    assert len(calls) == 3 * (2 + 2)


def test_split_keeps_the_npu_path(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    _check_split_equals_plain()
    assert fake.calls.count("npu_grouped_matmul") == 2 * (2 + 2)  # forward and input gradient
