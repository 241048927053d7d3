"""kernels/: every path that runs here against its plain-math reference, forward and backward.

NPU branches cannot run on this machine. Their argument preparation is tested directly, and the whole
NPU branch of each public op is run against a stand-in torch_npu whose functions implement the
formulas and input requirements that the torch_npu documentation states (tests/helpers/npu_fake.py).
"""

from __future__ import annotations

import ast
import importlib
import math
from pathlib import Path

import pytest
import torch

import kernels
from kernels.dispatch import OPS, KernelPaths, device_kind, kernel_paths
from tests.helpers.npu_fake import install_fake_npu

# kernels.attention and kernels.swiglu are the functions; the modules come from the import system.
attn_mod = importlib.import_module("kernels.attention")
norms_mod = importlib.import_module("kernels.norms")
rope_mod = importlib.import_module("kernels.rope")
swiglu_mod = importlib.import_module("kernels.swiglu")

FP32 = dict(atol=2e-5, rtol=2e-5)
BF16_REL = 2e-2  # relative L2 error allowed for bf16 against the fp32 reference


def _inputs(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_(True) for s in shapes]


def _run(fn, inputs, seed=123):
    """Output and gradients of every input under a fixed random upstream gradient."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad(out, xs, upstream)
    return out.detach(), [g.detach() for g in grads]


def _assert_close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, **FP32)
    else:
        err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        assert err < BF16_REL, f"relative error {err:.3e} >= {BF16_REL}"


def _compare(fused, reference, inputs, dtype):
    out_f, grads_f = _run(fused, inputs)
    out_r, grads_r = _run(reference, inputs)
    _assert_close(out_f, out_r, dtype)
    for gf, gr in zip(grads_f, grads_r):
        _assert_close(gf, gr, dtype)


DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b,n,sq,skv,d", [(2, 3, 7, 7, 16), (1, 2, 13, 13, 8), (1, 2, 5, 9, 8)])
def test_attention_matches_reference(dtype, causal, b, n, sq, skv, d):
    inputs = _inputs([(b, n, sq, d), (b, n, skv, d), (b, n, skv, d)], dtype, seed=sq * 10 + skv)
    _compare(lambda q, k, v: kernels.attention(q, k, v, causal=causal),
             lambda q, k, v: kernels.attention_reference(q, k, v, causal=causal), inputs, dtype)


def test_attention_custom_scale_and_reference_is_causal():
    q, k, v = _inputs([(1, 2, 6, 8)] * 3, torch.float32, seed=1)
    _compare(lambda q, k, v: kernels.attention(q, k, v, scale=0.3),
             lambda q, k, v: kernels.attention_reference(q, k, v, scale=0.3), [q, k, v], torch.float32)
    # Causality: changing the last key/value must not change any earlier query's output.
    out = kernels.attention_reference(q, k, v)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0
    out2 = kernels.attention_reference(q, k2, v2)
    torch.testing.assert_close(out[:, :, :-1], out2[:, :, :-1], atol=0, rtol=0)
    assert not torch.allclose(out[:, :, -1], out2[:, :, -1])


def test_attention_dropout_and_validation():
    q, k, v = _inputs([(1, 2, 6, 8)] * 3, torch.float32, seed=2)
    torch.manual_seed(0)
    a = kernels.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = kernels.attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.allclose(a, kernels.attention(q, k, v))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout_p"):
            kernels.attention(q, k, v, dropout_p=bad)
    with pytest.raises(ValueError, match=r"\(b, n_heads, s, d\)"):
        kernels.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="share"):
        kernels.attention(q[:, :1], k, v)  # q's 1 head cannot be grouped over 2 key/value heads


# ---------------------------------------------------------------- norms


NORMS = {
    "layer_norm": (lambda x, w, b: kernels.layer_norm(x, w, b, eps=1e-5),
                   lambda x, w, b: kernels.layer_norm_reference(x, w, b, eps=1e-5), 2),
    "rms_norm": (lambda x, w: kernels.rms_norm(x, w, eps=1e-6),
                 lambda x, w: kernels.rms_norm_reference(x, w, eps=1e-6), 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 24), (7, 33)])
@pytest.mark.parametrize("op", list(NORMS))
def test_norms_match_reference(op, dtype, shape):
    fused, reference, n_params = NORMS[op]
    inputs = _inputs([shape] + [(shape[-1],)] * n_params, dtype, seed=shape[-1] + n_params)
    _compare(fused, reference, inputs, dtype)


def test_norms_mixed_precision_and_bias_none():
    x = torch.randn(4, 16).bfloat16().requires_grad_(True)
    w = torch.randn(16, requires_grad=True)  # fp32 master weight
    for y in (kernels.rms_norm(x, w), kernels.layer_norm(x, w, None)):
        assert y.dtype == torch.bfloat16
        (gw,) = torch.autograd.grad(y.float().sum(), [w])
        assert gw.dtype == torch.float32
    xf = x.detach().float()
    _assert_close(kernels.layer_norm(xf, w.detach(), None), kernels.layer_norm_reference(xf, w.detach(), None),
                  torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        kernels.rms_norm(x, torch.ones(15))


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_norm_eps_is_honoured(eps):
    """Inputs of mean square ~1e-6, comparable to eps (randn's ~1 hides it), against the formulas
    in float64: a kernel that drops eps or takes another one fails."""
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((4, 64), (64,), (64,)))
    x = x * 1e-3
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    mean = x.mean(-1, keepdim=True)
    ln = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps) * w + b
    torch.testing.assert_close(kernels.rms_norm(x.float(), w.float(), eps).double(), rms, **FP32)
    torch.testing.assert_close(kernels.layer_norm(x.float(), w.float(), b.float(), eps).double(), ln, **FP32)


# ---------------------------------------------------------------- rope


def test_rope_cos_sin_convention_is_pairwise_rotation():
    """Channel i pairs with i + d/2 and turns by pos * base^(-2i/d): compare with complex rotation."""
    b, n, s, d, base, offset = 2, 3, 9, 12, 500.0, 4
    x = torch.randn(b, n, s, d, dtype=torch.float64)
    cos, sin = kernels.rope_cos_sin(s, d, base=base, dtype=torch.float64, offset=offset)
    assert cos.shape == sin.shape == (s, d)
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    pos = torch.arange(offset, offset + s, dtype=torch.float64)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(
        torch.ones(s, d // 2, dtype=torch.float64), torch.outer(pos, theta)
    )
    expected = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(kernels.apply_rope(x, cos, sin), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kernels.apply_rope_reference(x, cos, sin), expected, atol=1e-6, rtol=1e-6)


def test_rope_cos_sin_offset_and_validation():
    cos_full, sin_full = kernels.rope_cos_sin(11, 8)
    cos, sin = kernels.rope_cos_sin(6, 8, offset=5)
    torch.testing.assert_close(cos, cos_full[5:], atol=0, rtol=0)
    torch.testing.assert_close(sin, sin_full[5:], atol=0, rtol=0)
    assert kernels.rope_cos_sin(3, 8, dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="even"):
        kernels.rope_cos_sin(4, 7)
    with pytest.raises(ValueError, match=r"\(s, d\)"):
        kernels.apply_rope(torch.randn(1, 1, 4, 8), cos_full, sin_full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,n,s,d", [(2, 3, 7, 16), (1, 4, 13, 32)])
def test_apply_rope_matches_reference(dtype, b, n, s, d):
    (x,) = _inputs([(b, n, s, d)], dtype, seed=s)
    cos, sin = kernels.rope_cos_sin(s, d, offset=3)
    c = cos.clone().requires_grad_(True)
    si = sin.clone().requires_grad_(True)
    _compare(kernels.apply_rope, kernels.apply_rope_reference, [x, c, si], dtype)


# ---------------------------------------------------------------- swiglu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 24), (7, 33)])
def test_swiglu_matches_reference(dtype, shape):
    inputs = _inputs([shape, shape], dtype, seed=shape[-1] + 2)
    _compare(kernels.swiglu, kernels.swiglu_reference, inputs, dtype)
    with pytest.raises(ValueError, match="same shape"):
        kernels.swiglu(inputs[0], inputs[1][..., :-1])


# ---------------------------------------------------------------- NPU argument preparation


@pytest.mark.parametrize("sq,skv", [(1, 1), (7, 7), (13, 13), (5, 9)])
def test_causal_masks_equal_reference_mask(sq, skv):
    expected = torch.tensor([[j > i for j in range(skv)] for i in range(sq)])
    assert torch.equal(kernels.causal_mask(sq, skv), expected)
    compressed = attn_mod.npu_compressed_causal_mask()
    assert compressed.shape == (2048, 2048) and compressed.dtype == torch.bool
    assert torch.equal(compressed[:sq, :skv], expected)  # leftUpCausal = top-left of the triangle


def test_npu_mask_cache_reuses_one_mask_per_device():
    cache = kernels.NpuMaskCache()
    m1, m2 = cache.get("cpu"), cache.get(torch.device("cpu"))
    assert m1 is m2 and len(cache) == 1
    assert torch.equal(m1, attn_mod.npu_compressed_causal_mask())
    q = torch.randn(1, 2, 5, 8)
    assert attn_mod.npu_fusion_attention_kwargs(q, True, 0.0, None, cache)["atten_mask"] is m1


def test_npu_fusion_attention_kwargs():
    q = torch.randn(2, 3, 5, 16)
    kw = attn_mod.npu_fusion_attention_kwargs(q, causal=True, dropout_p=0.1, scale=None)
    assert kw["sparse_mode"] == 2 and kw["atten_mask"].shape == (2048, 2048)
    assert kw["scale"] == pytest.approx(1 / math.sqrt(16)) and kw["keep_prob"] == pytest.approx(0.9)
    kw = attn_mod.npu_fusion_attention_kwargs(q, causal=False, dropout_p=0.0, scale=0.5)
    assert kw == {"atten_mask": None, "scale": 0.5, "keep_prob": 1.0, "sparse_mode": 0}


def test_npu_attention_layout_avoids_copies():
    bnsd = [torch.randn(2, 3, 5, 8) for _ in range(3)]
    layout, *ts = attn_mod.npu_attention_layout(*bnsd)
    assert layout == "BNSD" and all(t is x for t, x in zip(ts, bnsd))
    bsnd = [torch.randn(2, 5, 3, 8) for _ in range(3)]  # e.g. (b, s, h) split into heads
    views = [t.transpose(1, 2) for t in bsnd]  # logical (b, n, s, d)
    layout, *ts = attn_mod.npu_attention_layout(*views)
    assert layout == "BSND"
    assert all(t.is_contiguous() and t.data_ptr() == x.data_ptr() for t, x in zip(ts, bsnd))
    odd = [torch.randn(5, 2, 8, 3).permute(1, 3, 0, 2) for _ in range(3)]  # neither layout
    layout, *ts = attn_mod.npu_attention_layout(*odd)
    assert layout == "BNSD" and all(t.is_contiguous() and torch.equal(t, x) for t, x in zip(ts, odd))
    out = torch.randn(2, 5, 3, 8)
    assert attn_mod.unpack_fusion_attention_output((out, None, None, None, 0, 0, 0), "BSND").shape == (2, 3, 5, 8)
    assert attn_mod.unpack_fusion_attention_output((out,) + (None,) * 6, "BNSD") is out


def test_npu_rms_norm_args():
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(8)
    (xa, wa), kw = norms_mod.npu_rms_norm_args(x, w, 1e-6)
    assert xa is x and wa.dtype == torch.bfloat16 and kw == {"epsilon": 1e-6}
    assert norms_mod.unpack_npu_rms_norm_output(("y", "rstd")) == "y"


def test_npu_rotary_args_and_limits():
    x = torch.randn(2, 4, 6, 128).bfloat16()
    cos, sin = kernels.rope_cos_sin(6, 128)
    layout, xa, r1, r2 = rope_mod.npu_rotary_args(x, cos, sin)
    assert layout == "BNSD" and xa is x and r1.shape == r2.shape == (1, 1, 6, 128)
    assert r1.dtype == torch.bfloat16
    assert torch.equal(r1[0, 0], cos.bfloat16()) and torch.equal(r2[0, 0], sin.bfloat16())
    bsnd = torch.randn(2, 6, 4, 128)  # (b, s, n, d) memory seen as (b, n, s, d)
    layout, xa, r1, r2 = rope_mod.npu_rotary_args(bsnd.transpose(1, 2), cos, sin)
    assert layout == "BSND" and xa.is_contiguous() and xa.data_ptr() == bsnd.data_ptr()
    assert r1.shape == r2.shape == (1, 6, 1, 128) and torch.equal(r1[0, :, 0], cos)
    # Ascend 910A / 910ProB: its own table
    old = "atlas-training"
    assert rope_mod.npu_rotary_supported(x, old)
    for d in (64, 256, 384):  # the table says D = 128 ("D维度数值为128"), not a multiple of it
        assert not rope_mod.npu_rotary_supported(torch.empty(2, 4, 6, d), old), d
    assert not rope_mod.npu_rotary_supported(torch.empty(8, 8, 6, 128), old)  # B*N > 8*S for BNSD
    assert rope_mod.npu_rotary_supported(torch.empty(8, 6, 8, 128).transpose(1, 2), old)  # not for BSND
    assert not rope_mod.npu_rotary_supported(torch.empty(1, 1001, 1000, 128), old)  # N > 1000
    # Atlas A2 / A3 with jit_compile=False: D even and below 896, B and N below 1000
    for d in (64, 96, 128, 256, 894):
        assert rope_mod.npu_rotary_supported(torch.empty(2, 4, 6, d)), d
    for d in (63, 896, 1024):
        assert not rope_mod.npu_rotary_supported(torch.empty(2, 4, 6, d)), d
    assert rope_mod.npu_rotary_supported(torch.empty(8, 8, 6, 128))  # no B*N <= 8*S rule there
    assert not rope_mod.npu_rotary_supported(torch.empty(1, 1000, 6, 128))  # N < 1000
    assert not rope_mod.npu_rotary_supported(torch.empty(1000, 1, 6, 128))  # B < 1000
    with pytest.raises(ValueError, match="unknown npu_rotary_mul table"):
        rope_mod.npu_rotary_supported(x, "a5")


def test_npu_swiglu_input_splits_back_to_gate_and_up():
    gate, up = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    packed = swiglu_mod.npu_swiglu_input(gate, up)
    assert packed.shape == (3, 5, 14) and packed.is_contiguous()
    a, b = packed.chunk(2, dim=swiglu_mod.NPU_SWIGLU_DIM)  # the documented split: A first, B second
    assert torch.equal(a, gate) and torch.equal(b, up)


# ---------------------------------------------------------------- NPU branches against documented semantics


@pytest.fixture
def fake_npu(monkeypatch):
    return install_fake_npu(monkeypatch)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bsnd_memory", [True, False])
def test_npu_attention_branch(fake_npu, causal, bsnd_memory):
    b, n, sq, skv, d = 2, 3, 5, 9, 16
    shapes = [(b, sq, n, d), (b, skv, n, d), (b, skv, n, d)] if bsnd_memory else \
        [(b, n, sq, d), (b, n, skv, d), (b, n, skv, d)]
    inputs = _inputs(shapes, torch.float32, seed=5)
    fix = (lambda t: t.transpose(1, 2)) if bsnd_memory else (lambda t: t)
    _compare(
        lambda q, k, v: kernels.attention(fix(q), fix(k), fix(v), causal=causal, mask_cache=kernels.NpuMaskCache()),
        lambda q, k, v: kernels.attention_reference(fix(q), fix(k), fix(v), causal=causal),
        inputs,
        torch.float32,
    )
    assert "npu_fusion_attention:" + ("BSND" if bsnd_memory else "BNSD") in fake_npu.calls


def test_npu_norm_swiglu_rope_branches(fake_npu):
    x, w, bias = _inputs([(3, 5, 24), (24,), (24,)], torch.float32, seed=6)
    _compare(kernels.rms_norm, kernels.rms_norm_reference, [x, w], torch.float32)
    _compare(kernels.layer_norm, kernels.layer_norm_reference, [x, w, bias], torch.float32)
    gate, up = _inputs([(3, 5, 24)] * 2, torch.float32, seed=7)
    _compare(kernels.swiglu, kernels.swiglu_reference, [gate, up], torch.float32)
    assert fake_npu.calls.count("npu_rms_norm") == 1 and fake_npu.calls.count("npu_swiglu") == 1

    cos, sin = kernels.rope_cos_sin(6, 128)
    for shape, view in (((1, 2, 6, 128), lambda t: t), ((1, 6, 2, 128), lambda t: t.transpose(1, 2))):
        (q,) = _inputs([shape], torch.float32, seed=8)
        _compare(lambda t: kernels.apply_rope(view(t), cos, sin),
                 lambda t: kernels.apply_rope_reference(view(t), cos, sin), [q], torch.float32)
    assert fake_npu.calls.count("npu_rotary_mul") == 2
    (small,) = _inputs([(1, 2, 6, 16)], torch.float32, seed=9)  # head_dim 16: A2/A3 take it
    cos, sin = kernels.rope_cos_sin(6, 16)
    _compare(lambda t: kernels.apply_rope(t, cos, sin), lambda t: kernels.apply_rope_reference(t, cos, sin),
             [small], torch.float32)
    assert fake_npu.calls.count("npu_rotary_mul") == 3
    ascend910a = KernelPaths(fusion_attention=False, swiglu=False, rotary_table="atlas-training")
    _compare(lambda t: kernels.apply_rope(t, cos, sin, paths=ascend910a),
             lambda t: kernels.apply_rope_reference(t, cos, sin), [small], torch.float32)
    assert fake_npu.calls.count("npu_rotary_mul") == 3  # outside the 910A's table: the plain expression


# ---------------------------------------------------------------- dispatch table and package hygiene


def test_kernel_paths_table():
    for dev in ("npu", "cuda", "cpu"):
        paths = kernel_paths(dev)
        assert tuple(paths) == OPS and all(isinstance(v, str) and v for v in paths.values())
    npu = kernel_paths("npu")
    assert npu["attention"].startswith("torch_npu.npu_fusion_attention")
    assert npu["rms_norm"].startswith("torch_npu.npu_rms_norm")
    assert npu["rope"].startswith("torch_npu.npu_rotary_mul")
    assert npu["swiglu"].startswith("torch_npu.npu_swiglu")
    assert "scaled_dot_product_attention" in kernel_paths("cuda:1")["attention"]
    assert kernel_paths("mps") == kernel_paths("cpu")
    kernel_paths("cpu")["attention"] = "changed"
    assert kernel_paths("cpu")["attention"] != "changed"
    with pytest.raises(ValueError, match="device_type"):
        kernel_paths("")
    assert device_kind(torch.zeros(1)) == "cpu" and device_kind("npu:3") == "npu"


def test_kernels_import_nothing_above_and_no_top_level_torch_npu():
    for path in Path(kernels.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("engine", "models", "parallel"), f"{path.name} imports {name}"
                assert name.split(".")[0] != "torch_npu", f"{path.name} imports torch_npu directly"
        assert "torch.cuda" not in path.read_text(), f"{path.name} uses torch.cuda"
