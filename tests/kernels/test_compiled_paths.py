"""The CUDA paths of RoPE and SwiGLU (kernels/compiled.py): each expression compiled regionally by
torch.compile. No GPU here, so the dispatch is pointed at CUDA (``device_kind`` answers "cuda";
the tensors stay on the CPU, where inductor compiles the same functions): apply_rope, swiglu and
swiglu_packed then run the compiled function, and its forward and every input gradient equal the
ops' references (fp32, and bf16 within its rounding), as does swiglu_packed_backward (the packed
derivative the grouped experts' backward calls); inside a compiled model the plain expression is
used, and on the CPU the compiled function is not. ``Regional`` (what every regional compilation
goes through, FP8's quantization too) runs the expression eagerly where a bare
``torch.compile(fullgraph=True)`` raises: past Dynamo's recompile limit and under a Python
dispatch mode. The experts' packed SwiGLU and its derivative compile with dynamic sizes: one
compilation for every row count."""
from __future__ import annotations

import collections
import importlib

import pytest
import torch

import kernels
from kernels import compiled as comp

rope_mod = importlib.import_module("kernels.rope")
swiglu_mod = importlib.import_module("kernels.swiglu")
gg = importlib.import_module("kernels.grouped_gemm")


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


def test_the_experts_swiglu_compiles_once_for_every_row_count(monkeypatch):
    """The experts' row count changes every call (the tokens routed to this rank's experts): the
    packed SwiGLU and its derivative compile with dynamic sizes, so the grouped MLP (its forward's
    activation, its hand-written backward's derivative) and the composition a zero-bubble store
    runs (``grouped_linear``, ``swiglu_packed`` under autograd, ``grouped_linear``) at three row
    counts compile each op's graphs at the first count only; static, every count was one more
    compilation of each. ``Regional``'s own count (its limit) stays at the first count's too.
    ``compiled`` builds the real Regionals, with a counting backend in place of inductor (Dynamo's
    guards decide a recompilation, not the backend)."""
    if not gg.torch_grouped_mm_runs("cpu", torch.float32):
        pytest.skip("this torch has no CPU torch._grouped_mm")
    graphs = collections.Counter()

    class Counting(comp.Regional):
        def __init__(self, fn, backend="inductor", limit=64, dynamic=False):
            def counting(gm, inputs):
                graphs[fn.__name__] += 1
                return gm.forward
            super().__init__(fn, counting, limit, dynamic)
    monkeypatch.setattr(comp, "Regional", Counting)
    monkeypatch.setattr(swiglu_mod, "device_kind", lambda t: "cuda")
    comp.compiled.cache_clear()
    torch._dynamo.reset()
    try:
        seen = []
        for n in (6, 11, 17):
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, 16, generator=g)                                    # (n, h)
            w_in, w_out = torch.randn(3, 16, 16, generator=g), torch.randn(3, 16, 8, generator=g)
            counts = [n // 3, n - n // 3 - 2, 2]
            offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)        # (G,)
            leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
            kernels.grouped_mlp(leaves[0], offsets, leaves[1], leaves[2], "swiglu").sum().backward()
            want = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
            y_ref = kernels.grouped_mlp_reference(want[0], counts, want[1], want[2], "swiglu")
            y_ref.sum().backward()
            for a, b in zip(leaves, want):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
            xs, wi, wo = (t.clone().requires_grad_() for t in (x, w_in, w_out))
            h = kernels.swiglu_packed(kernels.grouped_linear(xs, wi, offsets))      # (n, 8)
            kernels.grouped_linear(h, wo, offsets).sum().backward()
            seen.append(dict(graphs))
        assert set(seen[0]) == {"_swiglu_packed", "_swiglu_packed_backward"}, seen
        assert seen[0] == seen[-1], seen   # no compilation after the first row count
        sizes = {op: len(comp.compiled(op).compiled)
                 for op in ("swiglu_packed", "swiglu_packed_backward")}
        assert sizes == {"swiglu_packed": 2, "swiglu_packed_backward": 1}, sizes  # grad or not
    finally:
        comp.compiled.cache_clear()
        torch._dynamo.reset()


def test_dynamic_signatures_count_the_graphs_dynamo_compiles():
    """With dynamic sizes Dynamo compiles once for every size of 2 or more (0 and 1 are
    specialised), but once per shape of a Parameter (static: ``force_parameter_static_shapes``,
    FP8 quantizes the weights): ``Regional``'s signatures, which its limit counts, are the same."""
    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward

    def expr_dynamic(x):
        return (x * 2.0).clamp(-1.0, 1.0)
    torch._dynamo.reset()
    regional = comp.Regional(expr_dynamic, backend=counting, dynamic=True)
    try:
        with torch.no_grad():
            for x in [torch.randn(n, 4) for n in (3, 5, 9, 1)] + [
                    torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 4), (5, 4), (5, 4))]:
                torch.testing.assert_close(regional(x), expr_dynamic(x), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    assert len(regional.compiled) == len(graphs) == 4 and not regional.eager, regional.compiled
