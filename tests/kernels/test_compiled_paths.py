"""The CUDA paths of RoPE and SwiGLU (kernels/compiled.py): each expression compiled regionally by
torch.compile. No GPU here, so the dispatch is pointed at CUDA (``device_kind`` answers "cuda";
the tensors stay on the CPU, where inductor compiles the same functions): apply_rope, swiglu and
swiglu_packed then run the compiled function, and its forward and every input gradient equal the
ops' references (fp32, and bf16 within its rounding), as does swiglu_packed_backward (the packed
derivative the grouped experts' backward calls); inside a compiled model the plain expression is
used, and on the CPU the compiled function is not."""
from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels import compiled as comp

rope_mod = importlib.import_module("kernels.rope")
swiglu_mod = importlib.import_module("kernels.swiglu")


def _grads(fn, inputs, seed=1):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def _cases(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 32, generator=g).to(dtype)
    cos, sin = kernels.rope_cos_sin(16, 32, dtype=dtype)
    gate, up = (torch.randn(2, 16, 48, generator=g).to(dtype) for _ in range(2))
    return [("rope", lambda t: kernels.apply_rope(t, cos, sin),
             lambda t: kernels.apply_rope_reference(t, cos, sin), [x]),
            ("swiglu", kernels.swiglu, kernels.swiglu_reference, [gate, up]),
            ("swiglu_packed", kernels.swiglu_packed,
             lambda t: kernels.swiglu_reference(*t.chunk(2, -1)), [torch.cat([gate, up], -1)])]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_cuda_dispatch_runs_the_compiled_expression_equal_to_the_reference(monkeypatch, dtype, tol):
    calls = []
    real = comp.compiled

    def counting(op):
        calls.append(op)
        return real(op)
    for mod in (rope_mod, swiglu_mod):
        monkeypatch.setattr(mod, "device_kind", lambda t: "cuda")
        monkeypatch.setattr(mod, "compiled", counting)
    for name, fn, ref, inputs in _cases(dtype):
        calls.clear()
        got, want = _grads(fn, inputs), _grads(ref, inputs)
        assert calls == [name], (name, calls)
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, i=i: f"{name} {i}: {m}")


def test_plain_expression_on_the_cpu_and_inside_a_compiled_graph(monkeypatch):
    assert comp.use_compiled("cuda") and not comp.use_compiled("cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not comp.use_compiled("cuda")
    assert "compiled regionally" in kernels.kernel_paths("cuda")["rope"]
    assert "compiled regionally" in kernels.kernel_paths("cuda")["swiglu"]


def test_cuda_dispatch_compiles_the_packed_swiglu_derivative(monkeypatch):
    """The grouped experts' hand-written backward (kernels/grouped_experts.py) takes SwiGLU's
    packed derivative compiled on CUDA: equal to autograd's through the reference."""
    calls = []
    real = comp.compiled
    monkeypatch.setattr(swiglu_mod, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(swiglu_mod, "compiled", lambda op: calls.append(op) or real(op))
    g = torch.Generator().manual_seed(3)
    x, grad = torch.randn(6, 32, generator=g), torch.randn(6, 16, generator=g)
    got = kernels.swiglu_packed_backward(grad, x)
    assert calls == ["swiglu_packed_backward"]
    leaf = x.clone().requires_grad_()
    kernels.swiglu_reference(*leaf.chunk(2, -1)).backward(grad)
    torch.testing.assert_close(got, leaf.grad, rtol=1e-6, atol=1e-6)
