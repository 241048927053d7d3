"""Optional torch keywords are probed, never assumed (kernels/signatures.py).

The attention dispatch runs against stand-ins with the signatures of the torch releases the engine
supports: ``F.scaled_dot_product_attention`` without ``enable_gqa`` (2.4, a builtin whose docstring
carries its signature) and with it (2.5 on); ``varlen_attn`` with ``is_causal`` (2.10), with
``window_size`` but no ``enable_gqa`` (2.11), and with both (2.12, 2.13: the installed one). Each
stand-in accepts exactly its release's keywords (an unexpected one is a TypeError, as in torch) and
computes what that release documents; the dispatch's output must equal the reference attention.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.signatures import accepts, keyword_names

attn_mod = importlib.import_module("kernels.attention")

DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
CU = (0, 4, 7, 9, 14)
REAL_SDPA = F.scaled_dot_product_attention


def _qkv(n, g, dtype=torch.float32, b=2, s=7, d=8):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, n, s, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, g, s, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _segments(q, k, v, cu, scale):
    """Causal attention inside each [cu[i], cu[i+1]) of (T, H, D) tensors; equal head counts."""
    assert q.shape[1] == k.shape[1] == v.shape[1], "this release has no enable_gqa: heads must match"
    out = torch.empty_like(q)
    for a, b in zip(cu, cu[1:]):
        seg = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, H, len, D)
        out[a:b] = kernels.attention_reference(*seg, scale=scale)[0].transpose(0, 1)
    return out


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                return_aux=None, scale=None):
    assert is_causal
    return _segments(query, key, value, cu_seq_q.tolist(), scale)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    assert tuple(window_size) == (-1, 0)
    return _segments(query, key, value, cu_seq_q.tolist(), scale)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None):
    assert tuple(window_size) == (-1, 0)
    if key.shape[1] != query.shape[1]:
        assert enable_gqa
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return _segments(query, key, value, cu_seq_q.tolist(), scale)


class Sdpa24:
    """F.scaled_dot_product_attention of torch 2.4: a builtin (no Python signature) without
    enable_gqa, its signature on the first line of its docstring."""
    __doc__ = ("scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,\n"
               "        is_causal=False, scale=None) -> Tensor:\n\n    Computes ...")
    __signature__ = "not a signature"  # inspect.signature refuses it, as it refuses a builtin

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return REAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale)


def test_keywords_read_from_signatures_and_docstrings():
    assert accepts(varlen_2_13, "enable_gqa") and not accepts(varlen_2_11, "enable_gqa")
    assert accepts(varlen_2_10, "is_causal") and not accepts(varlen_2_10, "window_size")
    assert "enable_gqa" not in keyword_names(Sdpa24())
    assert {"attn_mask", "dropout_p", "is_causal", "scale"} <= keyword_names(Sdpa24())
    assert accepts(REAL_SDPA, "enable_gqa")  # the installed torch's builtin, read from its docstring


@pytest.mark.parametrize("varlen", [varlen_2_10, varlen_2_11, varlen_2_13], ids=["2.10", "2.11", "2.13"])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_varlen_call_fits_each_release(monkeypatch, varlen, groups):
    """The packed-document CUDA path (kernels.attention._attention_cuda_varlen) against each
    release's varlen_attn; on CPU tensors, with the stand-in in torch's module."""
    import torch.nn.attention.varlen as varlen_module
    monkeypatch.setattr(varlen_module, "varlen_attn", varlen)
    q, k, v = _qkv(4, groups, torch.bfloat16)
    out = attn_mod._attention_cuda_varlen(q, k, v, None, CU)
    ref = kernels.attention_reference(q, k, v, document_ids=DOCS)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 2e-2


def test_varlen_without_a_way_to_say_causal_is_not_used(monkeypatch):
    import torch.nn.attention.varlen as varlen_module

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("called without causal masking")
    monkeypatch.setattr(varlen_module, "varlen_attn", no_causal)
    q, k, v = _qkv(4, 4, torch.bfloat16)
    assert attn_mod._attention_cuda_varlen(q, k, v, None, CU) is None  # the SDPA path serves it


@pytest.mark.parametrize("packed", [False, True])
def test_sdpa_without_enable_gqa_repeats_the_heads(monkeypatch, packed):
    monkeypatch.setattr(F, "scaled_dot_product_attention", Sdpa24())
    q, k, v = _qkv(4, 2)
    kw = {"document_ids": DOCS} if packed else {}
    out = kernels.attention(q, k, v, **kw)
    torch.testing.assert_close(out, kernels.attention_reference(q, k, v, **kw), rtol=1e-5, atol=1e-5)


def test_packed_lengths_copied_to_the_device_once_per_micro_batch():
    """Every layer of a micro-batch passes the same host cu_seqlens: one device copy serves them."""
    cache = kernels.NpuMaskCache()
    q, k, v = _qkv(4, 2, torch.bfloat16)
    first = [attn_mod.cuda_varlen_args(q, k, v, CU, None, varlen_2_13, cache)[0][3] for _ in range(3)]
    assert first[0] is first[1] is first[2] and first[0].tolist() == list(CU)
    assert first[0].dtype == torch.int32
    other = (0, 7, 14)  # the next micro-batch's
    again = attn_mod.cuda_varlen_args(q, k, v, other, None, varlen_2_13, cache)[0][3]
    assert again is not first[0] and again.tolist() == [0, 7, 14]
