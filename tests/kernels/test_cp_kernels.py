"""Attention with the log-sum-exp of each query (kernels/attention_lse.py), the per-block math of ring
attention, against the fp32 reference that computes the whole formula at once.

- Every path (ATen's CPU flash kernel, the tiled plain-math path, the NPU path through the stand-in
  that implements npu_fusion_attention's documented semantics) returns the reference's out and lse,
  causal or not, with document masks and with fully masked queries (lse -inf, out 0), with fewer
  key/value heads.
- Backward given the block's own out and lse equals autograd through the reference.
- The ring's identity: keys split into blocks, partial results merged with ``merge_partial``, equal
  attention over all keys; each block's backward evaluated with the MERGED out and lse sums to the
  full gradients.
- NPU argument preparation: sparse modes, masks, layouts, and the statistics handed to the grad.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from kernels.attention_lse import (attention_lse, attention_lse_backward, attention_lse_blockwise,
                                   attention_lse_blockwise_backward, attention_lse_reference,
                                   merge_partial, npu_block_kwargs, npu_lse, npu_statistics)
from tests.helpers.npu_fake import COMPRESSED_CAUSAL, install_fake_npu

lse_mod = importlib.import_module("kernels.attention_lse")
TOL = dict(atol=2e-5, rtol=2e-5)


def _qkv(b=2, n=4, g=2, sq=6, sk=6, d=8, seed=0, bsnd=False):
    gen = torch.Generator().manual_seed(seed)
    if bsnd:  # as the model splits heads off a (b, s, (n + 2g) d) projection: transposed views
        q = torch.randn(b, sq, n, d, generator=gen).transpose(1, 2)
        k, v = (torch.randn(b, sk, g, d, generator=gen).transpose(1, 2) for _ in range(2))
        return q, k, v
    return (torch.randn(b, n, sq, d, generator=gen), torch.randn(b, g, sk, d, generator=gen),
            torch.randn(b, g, sk, d, generator=gen))


def _doc_mask(docs_q, docs_k):
    return (docs_q[:, :, None] != docs_k[:, None, :]).unsqueeze(1)  # (b, 1, sq, sk)


DOCS = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
MASK = _doc_mask(DOCS, DOCS)
EMPTY = MASK.clone()
EMPTY[0, 0, 3] = True  # query 3 of row 0 sees no key
EMPTY[1, 0, 0] = True

PATHS = {"dispatch": (attention_lse, attention_lse_backward),
         "blockwise": (attention_lse_blockwise, attention_lse_blockwise_backward)}


def _reference_grads(q, k, v, causal, mask, up):
    xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_lse_reference(*xs, causal, mask)
    return torch.autograd.grad(out, xs, up)


def _check_path(fwd, bwd, q, k, v, causal, mask):
    ref_out, ref_lse = attention_lse_reference(q, k, v, causal, mask)
    out, lse = fwd(q, k, v, causal, mask)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0), **TOL)
    up = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(5))
    for got, want in zip(bwd(up, q, k, v, ref_out, ref_lse, causal, mask),
                         _reference_grads(q, k, v, causal, mask, up)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, MASK, EMPTY], ids=["nomask", "documents", "empty-rows"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_paths_match_reference(path, causal, mask, groups):
    _check_path(*PATHS[path], *_qkv(g=groups), causal, mask)


def test_cpu_path_is_atens_flash_kernel(monkeypatch):
    """On CPU the dispatch runs ATen's kernel; without it, the blockwise path (same results)."""
    calls = []
    ops = lse_mod._aten_cpu_ops()
    assert ops is not None
    monkeypatch.setattr(lse_mod, "_aten_cpu_ops", lambda: (calls.append(1), ops)[1])
    attention_lse(*_qkv(), True)
    assert calls
    monkeypatch.setattr(lse_mod, "_aten_cpu_ops", lambda: None)
    _check_path(attention_lse, attention_lse_backward, *_qkv(), True, MASK)


def test_tiled_blockwise_path(monkeypatch):
    """Tiles of 2 query rows give what one tile gives."""
    monkeypatch.setattr(lse_mod, "TILE_ELEMENTS", 2 * (2 * 4 * 6))  # two rows of b * n * sk scores
    assert lse_mod._tiles(*_qkv()[:2]) == [(0, 2), (2, 4), (4, 6)]
    _check_path(attention_lse_blockwise, attention_lse_blockwise_backward, *_qkv(sk=6), True, EMPTY)


def test_merged_blocks_equal_attention_over_all_keys():
    """Split 12 keys into blocks of 4, 5 and 3 with packed documents: merged forward and the sum of
    the blocks' backwards (with the merged out and lse) are full attention's."""
    q, k, v = _qkv(sq=12, sk=12, seed=3)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2], [0] * 5 + [1] * 7])
    mask = _doc_mask(docs, docs) | torch.ones(12, 12, dtype=torch.bool).triu(1)
    full_out, full_lse = attention_lse_reference(q, k, v, False, mask)
    up = torch.randn(full_out.shape, generator=torch.Generator().manual_seed(1))
    want = _reference_grads(q, k, v, False, mask, up)
    for fwd, bwd in PATHS.values():
        blocks = [slice(0, 4), slice(4, 9), slice(9, 12)]
        out = torch.zeros(q.shape)
        lse = torch.full(q.shape[:3], float("-inf"))
        for ks in blocks:
            o, l = fwd(q, k[:, :, ks], v[:, :, ks], False, mask[..., ks])
            out, lse = merge_partial(out, lse, o, l)
        torch.testing.assert_close(out, full_out, **TOL)
        torch.testing.assert_close(lse, full_lse, **TOL)
        dq, dks, dvs = torch.zeros(q.shape), [], []
        for ks in blocks:
            gq, gk, gv = bwd(up, q, k[:, :, ks], v[:, :, ks], out, lse, False, mask[..., ks])
            dq += gq
            dks.append(gk), dvs.append(gv)
        torch.testing.assert_close(dq, want[0], **TOL)
        torch.testing.assert_close(torch.cat(dks, 2), want[1], **TOL)
        torch.testing.assert_close(torch.cat(dvs, 2), want[2], **TOL)


def test_merge_keeps_fully_masked_queries_out():
    out, lse = torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf"))
    o = torch.ones(1, 1, 2, 3)
    l = torch.tensor([[[0.5, float("-inf")]]])
    out, lse = merge_partial(out, lse, o, l)
    assert torch.equal(out[0, 0, 1], torch.zeros(3)) and lse[0, 0, 1] == float("-inf")
    torch.testing.assert_close(out[0, 0, 0], torch.ones(3))
    assert not torch.isnan(out).any()


def test_bfloat16_blocks_close_to_fp32_reference():
    q, k, v = (t.bfloat16() for t in _qkv())
    out, lse = attention_lse(q, k, v, True, MASK)
    ref, ref_lse = attention_lse_reference(q, k, v, True, MASK)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 2e-2
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)


# ---- NPU: argument preparation through the documented-semantics stand-in ----------------------

def test_npu_block_arguments():
    q = torch.zeros(2, 4, 6, 8)
    causal = npu_block_kwargs(q, True, None, None)
    assert causal["sparse_mode"] == 2 and torch.equal(causal["atten_mask"], COMPRESSED_CAUSAL)
    assert causal["scale"] == pytest.approx(8 ** -0.5) and causal["keep_prob"] == 1.0
    plain = npu_block_kwargs(q, False, None, 0.5)
    assert plain["sparse_mode"] == 0 and plain["atten_mask"] is None and plain["scale"] == 0.5
    docs = npu_block_kwargs(q, True, MASK, None)  # explicit (b, 1, sq, sk) mask, triangle folded in
    assert docs["sparse_mode"] == 0 and docs["atten_mask"].shape == (2, 1, 6, 6)
    assert torch.equal(docs["atten_mask"], MASK | torch.ones(6, 6, dtype=torch.bool).triu(1))


def test_npu_statistics_round_trip():
    lse = torch.tensor([[[0.3, float("-inf"), 2.0]]])
    smax, ssum = npu_statistics(lse)
    assert smax.shape == ssum.shape == (1, 1, 3, 8) and smax.dtype == torch.float32
    assert torch.equal(ssum, torch.ones_like(ssum)) and smax[0, 0, 1].eq(0).all()
    back = npu_lse(smax, ssum)
    torch.testing.assert_close(back[0, 0, [0, 2]], lse[0, 0, [0, 2]])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, EMPTY], ids=["nomask", "documents-empty-rows"])
@pytest.mark.parametrize("bsnd", [False, True])
def test_npu_path_matches_reference(monkeypatch, causal, mask, bsnd):
    """Forward from softmax_max/softmax_sum, backward through npu_fusion_attention_grad with the
    statistics of lse; the stand-in leaves a finite wrong lse on fully masked rows, which the
    kernel must override."""
    fake = install_fake_npu(monkeypatch)
    q, k, v = _qkv(bsnd=bsnd)
    _check_path(attention_lse, attention_lse_backward, q, k, v, causal, mask)
    layout = "BSND" if bsnd else "BNSD"
    assert fake.calls == [f"npu_fusion_attention:{layout}", f"npu_fusion_attention_grad:{layout}"]


def test_bad_shapes_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="mask must be"):
        attention_lse(q, k, v, False, MASK[:, :, :3])
    with pytest.raises(ValueError, match="dividing"):
        attention_lse(q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1))
