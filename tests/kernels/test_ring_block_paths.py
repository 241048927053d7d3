"""Which kernel runs a ring-attention block, and that each choice gives full attention's results.

- CUDA: PyTorch's flash kernel for fp16/bf16 blocks without a mask, the memory-efficient kernel for
  fp32 or masked blocks (packed documents), the blockwise fp32 path for head dims neither takes or
  a torch without them. The kernels run through a stand-in that enforces their input rules
  (tests/helpers/cuda_sdpa_fake.py); the real ones run in the device check on a GPU.
- NPU: npu_fusion_attention only where the chip table lists it (``KernelPaths.fusion_attention``),
  the portable path elsewhere (Atlas training series), in the layer and in the ring alike.
"""
from __future__ import annotations

import importlib

import pytest
import torch

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
