"""The CUDA paths of RoPE and SwiGLU (kernels/compiled.py): each expression compiled regionally by
torch.compile. No GPU here, so the dispatch is pointed at CUDA (``device_kind`` answers "cuda";
the tensors stay on the CPU, where inductor compiles the same functions): apply_rope, swiglu and
swiglu_packed then run the compiled function, and its forward and every input gradient equal the
ops' references (fp32, and bf16 within its rounding), as does swiglu_packed_backward (the packed
derivative the grouped experts' backward calls); inside a compiled model the plain expression is
used, and on the CPU the compiled function is not. ``Regional`` (what every regional compilation
goes through, FP8's quantization too) runs the expression eagerly where a bare
``torch.compile(fullgraph=True)`` raises: past Dynamo's recompile limit and under a Python
dispatch mode."""
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


SCALE = [1.0]   # read by the expressions below: Dynamo guards on its value


def _shapes(n: int) -> list[torch.Tensor]:
    return [torch.randn(k + 1, 3, generator=torch.Generator().manual_seed(k)) for k in range(n)]


def test_more_signatures_than_the_recompile_limit_run_eagerly():
    """torch.compile with fullgraph=True raises once a function has more input signatures than
    Dynamo's recompile limit (8; FP8's quantization meets a dozen in a GPT): ``Regional`` compiles
    up to its own limit (the process's limit raised while a new signature compiles) and runs the
    others eagerly, same values."""
    from torch._dynamo.exc import FailOnRecompileLimitHit
    torch._dynamo.reset()
    process_limit = torch._dynamo.config.recompile_limit

    def bare_expr(x):
        return (x * 2.0).clamp(-1.0, 1.0)

    def expr(x):
        return (x * 2.0).clamp(-1.0, 1.0)

    def expr_small(x):
        return (x * 2.0).clamp(-1.0, 1.0)
    bare = torch.compile(bare_expr, fullgraph=True, dynamic=False, backend="eager")
    with pytest.raises(FailOnRecompileLimitHit):  # what Regional is for
        for x in _shapes(process_limit + 1):
            bare(x)
    regional = comp.Regional(expr, backend="eager", limit=process_limit + 4)  # past the process's
    for x in _shapes(process_limit + 6) * 2:
        torch.testing.assert_close(regional(x), expr(x), rtol=0, atol=0)
    assert len(regional.compiled) == process_limit + 4 and len(regional.eager) == 2
    assert torch._dynamo.config.recompile_limit == process_limit           # put back
    regional = comp.Regional(expr_small, backend="eager", limit=3)         # or below it
    for x in _shapes(5):
        torch.testing.assert_close(regional(x), expr_small(x), rtol=0, atol=0)
    assert len(regional.compiled) == 3 and len(regional.eager) == 2

    # a guard the signature does not model (a global's value), past the process's limit: the
    # refused call runs eagerly
    def scaled(x):
        return x * SCALE[0]
    regional = comp.Regional(scaled, backend="eager")
    x = _shapes(1)[0]
    values = [float(v) for v in range(1, process_limit + 3)]
    try:
        for value in values:
            SCALE[0] = value
            torch.testing.assert_close(regional(x), x * value, rtol=0, atol=0)
    finally:
        SCALE[0] = 1.0
    assert regional.eager and not regional.compiled
    torch._dynamo.reset()


def test_a_dispatch_mode_runs_the_expression_eagerly():
    """Under a Python dispatch mode (the stream checker's, the host-wait counter's) torch.compile
    with fullgraph=True raises ("found no compiled frames"); ``Regional`` runs the expression."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def bare_expr(x):
        return x * 3.0 + 1.0

    def expr(x):
        return x * 3.0 + 1.0
    bare = torch.compile(bare_expr, fullgraph=True, dynamic=False, backend="eager")
    regional = comp.Regional(expr, backend="eager")
    x = _shapes(1)[0]
    with Passing():
        with pytest.raises(RuntimeError, match="no compiled frames"):
            bare(x)
        torch.testing.assert_close(regional(x), x * 3.0 + 1.0, rtol=0, atol=0)
    assert not regional.compiled and not regional.eager  # nothing was handed to Dynamo
    torch._dynamo.reset()


def test_a_backend_that_cannot_build_it_leaves_the_expression_running(capsys):
    """A compiler that fails (no working triton on a device) costs speed, not the run: one note
    line, then the expression on every call, with the bare compile's error for comparison."""
    from torch._dynamo.exc import BackendCompilerFailed

    def failing(gm, inputs):
        raise RuntimeError("no working triton")

    def bare_expr(x):
        return x * 5.0 - 1.0

    def expr(x):
        return x * 5.0 - 1.0
    bare = torch.compile(bare_expr, fullgraph=True, dynamic=False, backend=failing)
    with pytest.raises(BackendCompilerFailed):
        bare(_shapes(1)[0])
    regional = comp.Regional(expr, backend=failing)
    for x in _shapes(3):
        torch.testing.assert_close(regional(x), x * 5.0 - 1.0, rtol=0, atol=0)
    assert regional.broken
    assert capsys.readouterr().err == ("gridtron: note: torch.compile could not build expr "
                                       "(RuntimeError: no working triton); it runs uncompiled\n")
    torch._dynamo.reset()
