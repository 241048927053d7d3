"""Which kernel runs a ring-attention block, and that each choice gives full attention's results.

- CUDA: PyTorch's flash kernel for fp16/bf16 blocks without a mask on compute capability 8.0 or
  later, the memory-efficient kernel for fp32 or masked blocks (packed documents), below 8.0
  (fp16 there; bf16 has no kernel) and for causal blocks with sq != sk (flash's causal is
  bottom-right there, as the stand-in's is), the blockwise fp32 path for head dims neither takes
  or a torch without them. The capability comes from the engine (``DeviceInfo.capability`` ->
  ``KernelPaths.cuda_capability``). The kernels run through a stand-in that enforces their input
  and device rules (tests/helpers/cuda_sdpa_fake.py); the real ones run in the device check on a
  GPU.
- NPU: npu_fusion_attention only where the chip table lists it (``KernelPaths.fusion_attention``),
  the portable path elsewhere (Atlas training series), in the layer and in the ring alike.
- Other device types (xpu, mps, ...): the blockwise path (ATen's CPU op has CPU and Meta kernels).
"""
from __future__ import annotations

import importlib
import types

import pytest
import torch

import engine.device.runtime as device_mod
from kernels.attention_lse import (attention_lse, attention_lse_backward, attention_lse_reference,
                                   block_path, merge_partial)
from kernels.attention_lse_cuda import cuda_block_kernel
from kernels.dispatch import KernelPaths
from parallel.runtime.comm import single_rank_group
from parallel.context_parallel import ring_attention
from tests.helpers.cuda_sdpa_fake import CudaSdpaFake
from tests.helpers.npu_fake import install_fake_npu

lse_mod = importlib.import_module("kernels.attention_lse")
NO_FUSION = KernelPaths(fusion_attention=False)


def _qkv(n=4, g=2, s=12, d=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, s, d, generator=gen).to(dtype) for h in (n, g, g))


def _lse64(q, k, v, causal):
    """(out, lse) in float64 from the formula, top-left causal (query i sees keys 0..i); query head
    i reads key/value head i // (n / n_kv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (b, n, sq, sk)
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None], float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def _docs_mask(s=12):
    docs = torch.tensor([[0] * 4 + [1] * 5 + [2] * 3, [0] * 11 + [1]])
    return (docs[:, :, None] != docs[:, None, :]).unsqueeze(1)  # (b, 1, s, s)


@pytest.fixture
def cuda(monkeypatch):
    fake = CudaSdpaFake()
    monkeypatch.setattr(lse_mod, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(lse_mod, "cuda_ops", fake.ops)
    return fake


def test_cuda_kernel_choice():
    ops = CudaSdpaFake().ops()
    q16, q32 = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 4, 64)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    assert cuda_block_kernel(q16, None, ops) == "flash"
    assert cuda_block_kernel(q16, mask, ops) == "efficient"
    assert cuda_block_kernel(q32, None, ops) == "efficient"
    assert cuda_block_kernel(torch.zeros(1, 2, 4, 60, dtype=torch.bfloat16), None, ops) is None
    assert cuda_block_kernel(torch.zeros(1, 2, 4, 512, dtype=torch.bfloat16), None, ops) == "efficient"
    assert cuda_block_kernel(q16, None, {}) is None


def test_cuda_kernel_choice_follows_the_compute_capability():
    """flash_api.cpp refuses flash below 8.0 (V100 7.0, T4 7.5), cutlassF/B have no bf16 kernel
    there: fp16 takes efficient attention, bf16 the blockwise path; None (not told) counts as 8.0+."""
    ops = CudaSdpaFake().ops()
    q16, qbf, q32 = (torch.zeros(1, 2, 4, 64, dtype=t) for t in (torch.float16, torch.bfloat16,
                                                                 torch.float32))
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    for cc in ((7, 0), (7, 5)):
        assert cuda_block_kernel(q16, None, ops, cc) == "efficient"
        assert cuda_block_kernel(q16, mask, ops, cc) == "efficient"
        assert cuda_block_kernel(q32, None, ops, cc) == "efficient"
        assert cuda_block_kernel(qbf, None, ops, cc) is None
        assert cuda_block_kernel(qbf, mask, ops, cc) is None
    for cc in ((8, 0), (8, 6), (9, 0), (10, 0), None):
        assert cuda_block_kernel(q16, None, ops, cc) == cuda_block_kernel(qbf, None, ops, cc) == "flash"
        assert cuda_block_kernel(qbf, mask, ops, cc) == "efficient"


@pytest.mark.parametrize("capability,kernel", [((7, 0), "efficient"), ((7, 5), "efficient"),
                                               ((8, 0), "flash"), ((9, 0), "flash")])
def test_cuda_ring_blocks_follow_the_compute_capability(monkeypatch, capability, kernel):
    """fp16 ring attention (cp > 1 in fp16 on a V100 or T4) on a GPU whose flash kernel raises below
    8.0 as PyTorch's does: efficient attention there, flash from 8.0, full causal attention's
    output and gradients either way."""
    fake = CudaSdpaFake(capability)
    monkeypatch.setattr(lse_mod, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(lse_mod, "cuda_ops", fake.ops)
    paths = KernelPaths(cuda_capability=capability)
    q, k, v = (t.requires_grad_(True) for t in _qkv(dtype=torch.float16))
    assert block_path(q, None, paths) == f"cuda-{kernel}"
    out = ring_attention(q, k, v, single_rank_group("cp"), paths=paths)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), up)
    assert set(fake.calls) == {kernel, f"{kernel}_backward"}
    xs = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    want_out = attention_lse_reference(*xs, True)[0]
    want = torch.autograd.grad(want_out, xs, up.float())
    tol = dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), want_out, **tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, **tol)


def test_cuda_bf16_ring_below_sm80_runs_blockwise(monkeypatch):
    fake = CudaSdpaFake((7, 5))
    monkeypatch.setattr(lse_mod, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(lse_mod, "cuda_ops", fake.ops)
    paths = KernelPaths(cuda_capability=(7, 5))
    q, k, v = _qkv(dtype=torch.bfloat16)
    assert block_path(q, None, paths) == "blockwise"
    out = ring_attention(q, k, v, single_rank_group("cp"), paths=paths)
    assert fake.calls == []
    want = attention_lse_reference(*(t.float() for t in (q, k, v)), True)[0]
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


def test_cuda_device_hands_its_capability_to_the_block_kernel(monkeypatch):
    """setup_device puts the GPU's compute capability into DeviceInfo.kernel_paths, the paths the
    model hands to every ring block."""
    fake_cuda = types.SimpleNamespace(set_device=lambda i: None, get_device_name=lambda i: "Tesla V100",
                                      get_device_capability=lambda i: (7, 0),
                                      is_available=lambda: True, device_count=lambda: 1)
    monkeypatch.setattr(device_mod.torch, "cuda", fake_cuda)
    dev = device_mod.setup_device("cuda")
    assert dev.capability == dev.kernel_paths.cuda_capability == (7, 0)
    monkeypatch.setattr(lse_mod, "device_kind", lambda t: "cuda")
    monkeypatch.setattr(lse_mod, "cuda_ops", CudaSdpaFake((7, 0)).ops)
    assert block_path(torch.zeros(1, 2, 4, 64, dtype=torch.float16), None,
                      dev.kernel_paths) == "cuda-efficient"


def _blocks_against_full(q, k, v, mask, tol):
    """Two key blocks visited as the ring does, merged, against causal attention over all keys;
    the blocks' backwards with the merged statistics sum to the full gradients."""
    s = q.shape[2]
    h = s // 2
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).expand(q.shape[0], 1, s, s)
    full = causal if mask is None else (mask | causal)
    want_out, want_lse = attention_lse_reference(q, k, v, False, full)
    up = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    xs = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(attention_lse_reference(*xs, False, full)[0], xs, up.float())
    # (query slice, key slice, causal): the first half's queries see block A causally, the second
    # half's see block A whole and block B causally (as the ring's steps do)
    steps = [(slice(0, h), slice(0, h), True), (slice(h, s), slice(0, h), False),
             (slice(h, s), slice(h, s), True)]
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    for qs, ks, c in steps:
        m = None if mask is None else mask[:, :, qs, ks]
        o, l = attention_lse(q[:, :, qs], k[:, :, ks], v[:, :, ks], c, m)
        out[:, :, qs], lse[:, :, qs] = merge_partial(out[:, :, qs], lse[:, :, qs], o, l)
    torch.testing.assert_close(out, want_out.float(), **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    merged = out.to(q.dtype)
    for qs, ks, c in steps:
        m = None if mask is None else mask[:, :, qs, ks]
        gq, gk, gv = attention_lse_backward(up[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                            merged[:, :, qs], lse[:, :, qs], c, m)
        dq[:, :, qs] += gq.float()
        dk[:, :, ks] += gk.float()
        dv[:, :, ks] += gv.float()
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("groups", [1, 2])
def test_cuda_flash_blocks_equal_full_attention(cuda, groups):
    q, k, v = _qkv(g=groups, dtype=torch.bfloat16)
    _blocks_against_full(q, k, v, None, dict(atol=3e-2, rtol=3e-2))
    assert set(cuda.calls) == {"flash", "flash_backward"}


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_efficient_blocks_equal_full_attention(cuda, groups, masked):
    q, k, v = _qkv(g=groups)
    _blocks_against_full(q, k, v, _docs_mask() if masked else None, dict(atol=2e-5, rtol=2e-5))
    assert set(cuda.calls) == {"efficient", "efficient_backward"}


def test_cuda_unsupported_head_dim_runs_blockwise(cuda):
    q, k, v = _qkv(d=6)
    assert block_path(q) == "blockwise"
    _blocks_against_full(q, k, v, _docs_mask(), dict(atol=2e-5, rtol=2e-5))
    assert cuda.calls == []


def test_npu_blocks_follow_the_chip_table(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    q, k, v = _qkv()
    assert block_path(q, None, NO_FUSION) == "blockwise" and block_path(q) == "npu"
    out, lse = attention_lse(q, k, v, True, paths=NO_FUSION)
    attention_lse_backward(torch.ones_like(out), q, k, v, out, lse, True, paths=NO_FUSION)
    assert fake.calls == []
    want_out, want_lse = attention_lse_reference(q, k, v, True)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    attention_lse(q, k, v, True)
    assert fake.calls == ["npu_fusion_attention:BNSD"]


def test_ring_attention_hands_the_chip_table_to_its_blocks(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    q, k, v = _qkv()
    group = single_rank_group("cp")
    out = ring_attention(q, k, v, group, paths=NO_FUSION)
    assert fake.calls == []
    torch.testing.assert_close(out, attention_lse_reference(q, k, v, True)[0], atol=2e-5, rtol=2e-5)
    ring_attention(q, k, v, group)
    assert fake.calls == ["npu_fusion_attention:BNSD"]


def test_cuda_stand_in_flash_is_bottom_right_causal_for_unequal_lengths():
    """As FlashAttention 2 (and so PyTorch's flash kernel): query i sees keys 0..i + sk - sq."""
    q, k, v = (t[:, :2] for t in _qkv(n=2, g=2, s=8, d=8, dtype=torch.bfloat16))
    q = q[:, :, :4]  # 4 queries, 8 keys
    lse = CudaSdpaFake().flash(q, k, v, 0.0, True, scale=8 ** -0.5)[1]  # (b, n, sq)
    right = _lse64(q, k, v, False)  # the last query sees every key ...
    torch.testing.assert_close(lse[:, :, -1].double(), right[1][:, :, -1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lse.double(), _lse64(q, k, v, True)[1], atol=1e-2)  # ... not top-left


@pytest.mark.parametrize("sq,sk", [(4, 8), (8, 4)])
def test_cuda_causal_blocks_of_unequal_lengths_never_take_flash(cuda, sq, sk):
    """attention_lse's causal is top-left; flash's is bottom-right when sq != sk: efficient
    attention (top-left for any lengths) serves those blocks, forward and backward."""
    ops = CudaSdpaFake().ops()
    qs = torch.zeros(1, 2, sq, 64, dtype=torch.bfloat16)
    assert cuda_block_kernel(qs, None, ops, None, True, sk) == "efficient"
    assert cuda_block_kernel(qs, None, ops, None, True, sq) == "flash"  # square: the same mask
    assert cuda_block_kernel(qs, None, ops, None, False, sk) == "flash"  # not causal
    assert cuda_block_kernel(qs.half(), None, ops, (7, 5), True, sk) == "efficient"
    assert cuda_block_kernel(qs, None, ops, (7, 5), True, sk) is None  # bf16 below 8.0: blockwise
    q = _qkv(s=sq, d=64, dtype=torch.bfloat16)[0].requires_grad_(True)
    k, v = (t.requires_grad_(True) for t in _qkv(s=sk, d=64, dtype=torch.bfloat16, seed=1)[1:])
    out, lse = attention_lse(q, k, v, True)
    want_out, want_lse = _lse64(q, k, v, True)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-2, rtol=1e-2)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = attention_lse_backward(up.bfloat16(), q, k, v, out, lse, True)
    want = torch.autograd.grad(want_out, (q, k, v), up.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=3e-2, rtol=3e-2)
    assert cuda.calls == ["efficient", "efficient_backward"]


@pytest.mark.parametrize("device", ["xpu", "mps", "hpu"])
def test_other_device_types_take_the_blockwise_path(device):
    """ATen's _scaled_dot_product_flash_attention_for_cpu has CPU and Meta kernels only."""
    class Elsewhere(torch.Tensor):
        @property
        def device(self):
            return torch.device(device)
    assert block_path(torch.zeros(1, 2, 4, 8).as_subclass(Elsewhere)) == "blockwise"
    for here in ("cpu", "meta"):
        assert block_path(torch.zeros(1, 2, 4, 8, device=here)) == "cpu-flash"
