"""Grouped-query attention and packed documents in kernels/attention.py and kernels/rope.py.

- Fewer key/value heads (G = 1, 2 and n) on the CPU path match the fp32 reference, forward and
  backward, and equal attention with the key/value heads repeated (query head i reads head i // (n/G)).
- A batch of packed documents gives, token for token, what each document gives alone.
- Cumulative lengths: worked examples, both directions, and a shard recomputes its own.
- Causal and non-causal packed documents against a float64 softmax written here from the formula.
- NPU: fewer KV heads go to npu_fusion_attention as they are (BNSD/BSND); packed documents go in the
  TND layout, contiguous, with actual_seq_qlen/kvlen = the cumulative ends and sparse_mode 3 (0 when
  not causal), also for q, k, v split off the fused QKV projection as the model splits them; checked
  through a stand-in that implements the documented semantics (tests/helpers/npu_fake.py).
- CUDA varlen: the argument preparation for torch.nn.attention.varlen.varlen_attn (which needs a GPU),
  fed to a plain per-segment evaluation of its documented semantics; inside a compiled graph the
  mask instead (one graph over every document count).
- Packed-document inputs that break the contract (a piece across a row end, decreasing ids) raise.
"""
from __future__ import annotations

import importlib
import math
import types

import pytest
import torch

import kernels
from models.batch import AttentionInputs
from models.layers import ParallelAttention
from tests.helpers.npu_fake import install_fake_npu

attn_mod = importlib.import_module("kernels.attention")
FP32 = dict(atol=2e-5, rtol=2e-5)


def _qkv(b, n, g, s, d, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, s, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, g, s, d, generator=gen).to(dtype) for _ in range(2))
    return [t.requires_grad_(True) for t in (q, k, v)]


def _out_and_grads(fn, inputs, seed=7):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, xs, up)]


def _fused_qkv(b, n, g, s, d, seed=0):
    """A (b, s, (n + 2g) d) projection output and the q, k, v views ParallelAttention.split_qkv makes
    of it (strided: k and v keep the projection's row and head strides)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, (n + 2 * g) * d, generator=gen).requires_grad_(True)
    layer = types.SimpleNamespace(q_per_group=n // g, head_dim=d, groups_local=g, heads_local=n)
    return qkv, ParallelAttention.split_qkv(layer, qkv)


def _attention64(q, k, v, causal, docs):
    """softmax(q k^T / sqrt(d) + mask) v in float64, from the formula: key j takes part for query i
    when both carry the same id (and j <= i); query head i reads key/value head i // (n / n_kv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, n, s, s)
    keep = docs[:, None, :, None] == docs[:, None, None, :]  # (b, 1, s, s)
    if causal:
        s = q.shape[2]
        keep = keep & (torch.arange(s)[None, :] <= torch.arange(s)[:, None])
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def _close(a_list, b_list, dtype=torch.float32):
    for a, b in zip(a_list, b_list):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, **FP32)
        else:
            assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2


# rows [a a a a | b b b] and [c c | d d d d d]: documents of lengths 4, 3 and 2, 5
DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
CU = (0, 4, 7, 9, 14)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_key_value_heads_match_reference_and_repetition(groups, dtype):
    q, k, v = _qkv(2, 4, groups, 7, 8, dtype=dtype)
    _close(_out_and_grads(kernels.attention, [q, k, v]),
           _out_and_grads(kernels.attention_reference, [q, k, v]), dtype)
    rep = 4 // groups  # the same as multi-head attention over repeated key/value heads
    out = kernels.attention(q, k, v)
    full = kernels.attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
    _close([out], [full], dtype)
    if 1 < groups < 4:  # and not the same as another grouping of the query heads
        other = kernels.attention(q, k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1))
        assert not torch.allclose(out.float(), other.float(), atol=1e-2)


@pytest.mark.parametrize("groups", [1, 4])
def test_packed_documents_equal_documents_alone(groups):
    q, k, v = _qkv(2, 4, groups, 7, 8, seed=1)
    for fn in (kernels.attention, kernels.attention_reference):
        packed = fn(q, k, v, document_ids=DOCS)
        for row, spans in ((0, [(0, 4), (4, 7)]), (1, [(0, 2), (2, 7)])):
            for a, b in spans:
                alone = fn(*(t[row:row + 1, :, a:b] for t in (q, k, v)))
                torch.testing.assert_close(packed[row:row + 1, :, a:b], alone, **FP32)
    # the kernel takes either description of the documents, with gradients like the reference
    ref = _out_and_grads(lambda *t: kernels.attention_reference(*t, document_ids=DOCS), [q, k, v])
    _close(_out_and_grads(lambda *t: kernels.attention(*t, document_ids=DOCS), [q, k, v]), ref)
    _close(_out_and_grads(lambda *t: kernels.attention(*t, cu_seqlens=CU), [q, k, v]), ref)
    assert not torch.allclose(kernels.attention(q, k, v), ref[0])  # the mask does something


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_match_an_independent_reference(causal):
    q, k, v = _qkv(2, 4, 2, 7, 8, seed=6)
    want = _out_and_grads(lambda *t: _attention64(*t, causal, DOCS).float(), [q, k, v])
    for docs in (dict(document_ids=DOCS), dict(cu_seqlens=CU), dict(document_ids=DOCS, cu_seqlens=CU)):
        _close(_out_and_grads(lambda *t: kernels.attention(*t, causal=causal, **docs), [q, k, v]), want)


def test_cumulative_lengths_and_masks():
    assert kernels.cu_seqlens_from_document_ids(DOCS) == CU
    assert kernels.cu_seqlens_from_document_ids(torch.tensor([[0, 0, 1], [0, 1, 1]])) == (0, 2, 3, 4, 6)
    assert kernels.cu_seqlens_from_document_ids(torch.zeros(3, 4, dtype=torch.int32)) == (0, 4, 8, 12)
    ids = attn_mod.document_ids_from_cu_seqlens(CU, 2, 7)
    assert kernels.cu_seqlens_from_document_ids(ids) == CU
    mask = kernels.document_mask(torch.tensor([[0, 0, 1]]))  # True = masked
    assert mask.shape == (1, 1, 3, 3)
    assert mask[0, 0].tolist() == [[False, True, True], [False, False, True], [True, True, False]]
    inputs = AttentionInputs(torch.arange(7).expand(2, 7), DOCS, CU)
    shard = inputs.narrow(3, 3)  # tokens 3..5 of each row, e.g. a context-parallel shard
    assert shard.position_ids.tolist() == [[3, 4, 5]] * 2
    assert shard.document_ids.tolist() == [[0, 1, 1], [1, 1, 1]] and shard.cu_seqlens == (0, 1, 3, 6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        AttentionInputs(torch.zeros(2, 7, dtype=torch.long), DOCS)
    with pytest.raises(ValueError, match="b\\*s"):
        AttentionInputs(torch.zeros(2, 7, dtype=torch.long), DOCS, (0, 4, 7))
    with pytest.raises(ValueError, match="equal query and key lengths"):
        q, k, v = _qkv(2, 4, 2, 7, 8)
        kernels.attention(q, k[:, :, :5], v[:, :, :5], document_ids=DOCS)


def test_rope_at_positions_equals_table_rows():
    cos, sin = kernels.rope_cos_sin(16, 8, 500.0)
    pos = torch.tensor([[0, 1, 2, 0, 1, 5], [3, 4, 0, 1, 2, 3]])
    c, s = kernels.rope_cos_sin_at(pos, 8, 500.0)
    assert c.shape == s.shape == (2, 1, 6, 8)
    assert torch.equal(c[:, 0], cos[pos]) and torch.equal(s[:, 0], sin[pos])  # bitwise
    x = torch.randn(2, 3, 6, 8)
    torch.testing.assert_close(kernels.apply_rope(x, c, s), kernels.apply_rope_reference(x, c, s))


# ---------------------------------------------------------------- NPU


@pytest.mark.parametrize("bsnd_memory", [False, True])
def test_npu_grouped_query_attention_branch(monkeypatch, bsnd_memory):
    fake = install_fake_npu(monkeypatch)
    b, n, g, s, d = 2, 4, 2, 7, 8
    if bsnd_memory:  # key/value heads as views of (b, s, g, d) memory, as a projection gives them
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(b, n, g, s, d))
    else:
        q, k, v = _qkv(b, n, g, s, d)
    cache = kernels.NpuMaskCache()
    _close(_out_and_grads(lambda *t: kernels.attention(*t, mask_cache=cache), [q, k, v]),
           _out_and_grads(kernels.attention_reference, [q, k, v]))
    assert fake.calls[-1] == "npu_fusion_attention:" + ("BSND" if bsnd_memory else "BNSD")


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_npu_packed_documents_go_as_tnd(monkeypatch, groups, causal):
    """q, k, v as the model makes them, split off the fused QKV projection (strided views, which the
    stand-in refuses as the BNSD/BSND branch's contract says), and as plain BNSD tensors; not
    causal: sparse_mode 0 without a mask (the stand-in refuses a mask or another mode there)."""
    fake = install_fake_npu(monkeypatch)
    qkv, (q, k, v) = _fused_qkv(2, 4, groups, 7, 8, seed=3)
    plain = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]  # (b, n, s, d) memory
    up = torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(9))
    for docs in (dict(document_ids=DOCS, cu_seqlens=CU), dict(document_ids=DOCS), dict(cu_seqlens=CU)):
        out = kernels.attention(q, k, v, causal=causal, **docs)
        want = _attention64(q, k, v, causal, DOCS)
        torch.testing.assert_close(out.double(), want, **FP32)
        (grad,) = torch.autograd.grad(out, qkv, up)
        (want_grad,) = torch.autograd.grad(want, qkv, up.double())
        torch.testing.assert_close(grad, want_grad, **FP32)
        _close(_out_and_grads(lambda *t: kernels.attention(*t, causal=causal, **docs), plain),
               _out_and_grads(lambda *t: _attention64(*t, causal, DOCS).float(), plain))
    assert fake.calls == ["npu_fusion_attention:TND"] * 6  # one call per forward
    kw = attn_mod.npu_varlen_kwargs(q, CU, causal=False, dropout_p=0.0, scale=None)
    assert kw["sparse_mode"] == 0 and kw["atten_mask"] is None


def test_npu_packed_documents_kwargs():
    q = torch.empty(2, 4, 7, 8)
    kw = attn_mod.npu_varlen_kwargs(q, CU, causal=True, dropout_p=0.1, scale=None)
    assert kw["actual_seq_qlen"] == kw["actual_seq_kvlen"] == [4, 7, 9, 14]  # no leading 0
    assert kw["sparse_mode"] == 3 and torch.equal(kw["atten_mask"], attn_mod.npu_compressed_causal_mask())
    assert kw["keep_prob"] == pytest.approx(0.9) and kw["scale"] == pytest.approx(8 ** -0.5)
    many = tuple(range(0, 1026))  # 1025 one-token documents
    with pytest.raises(ValueError, match="at most 1024 document pieces.*--micro-batch-size"):
        attn_mod.npu_varlen_kwargs(q, many, True, 0.0, None)


def test_tnd_layout_of_projection_memory():
    bsnd = torch.randn(2, 7, 4, 8)  # (b, s, n, d): heads split off a (b, s, h) projection
    t = attn_mod.to_tnd(bsnd.transpose(1, 2))
    assert t.shape == (14, 4, 8) and t.data_ptr() == bsnd.data_ptr() and t.is_contiguous()
    assert torch.equal(t[8], bsnd[1, 1])  # token 1 of row 1
    assert torch.equal(attn_mod.from_tnd(t, 2, 7), bsnd.transpose(1, 2))
    _, (_, k, _) = _fused_qkv(2, 4, 2, 7, 8)  # the fused projection's k: a strided TND view
    tk = attn_mod.to_tnd(k)
    assert tk.data_ptr() == k.data_ptr() and not tk.is_contiguous()  # the NPU branch copies it
    assert torch.equal(tk[8], k[1, :, 1])


# ---------------------------------------------------------------- CUDA varlen


def _varlen_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch.nn.attention.varlen.varlen_attn as documented: (T, H, D) tensors split at the
    cumulative positions; window (-1, 0) is causal; fewer key/value heads only with enable_gqa."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and window_size == (-1, 0)
    assert enable_gqa == (k.shape[1] != q.shape[1])
    cu = cu_q.tolist()
    assert cu == cu_k.tolist() and max_q == max_k == max(b - a for a, b in zip(cu, cu[1:]))
    out = torch.empty_like(q)
    for a, b in zip(cu, cu[1:]):
        seg = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, H, len, D)
        out[a:b] = kernels.attention_reference(*seg, scale=scale)[0].transpose(0, 1)
    return out


def test_cuda_varlen_argument_preparation():
    q, k, v = _qkv(2, 4, 2, 7, 8, seed=4, dtype=torch.bfloat16)
    args, kwargs = attn_mod.cuda_varlen_args(q, k, v, CU, None)
    assert [tuple(t.shape) for t in args[:3]] == [(14, 4, 8), (14, 2, 8), (14, 2, 8)]
    assert args[3].tolist() == list(CU) and args[5:] == (5, 5)
    out = attn_mod.from_tnd(_varlen_semantics(*args, **kwargs), 2, 7)
    _close([out], [kernels.attention_reference(q, k, v, document_ids=DOCS)], torch.bfloat16)
    assert attn_mod.cuda_varlen_usable(q, True, 0.0)
    assert not attn_mod.cuda_varlen_usable(q, True, 0.1)  # varlen_attn has no dropout
    assert not attn_mod.cuda_varlen_usable(q.float(), True, 0.0)  # flash: half precision only
    assert not attn_mod.cuda_varlen_usable(torch.empty(1, 1, 2, 12, dtype=torch.bfloat16), True, 0.0)
    # flash refuses GPUs before sm80 (V100 7.0, T4 7.5): the masked SDPA path there
    assert attn_mod.cuda_varlen_usable(q, True, 0.0, (8, 0)) and attn_mod.cuda_varlen_usable(q, True, 0.0, (9, 0))
    assert not attn_mod.cuda_varlen_usable(q, True, 0.0, (7, 5))
    assert not attn_mod.cuda_varlen_usable(q, False, 0.0)  # window (-1, 0) would make it causal
    wide = [torch.empty(1, 1, 2, d, dtype=torch.bfloat16) for d in (256, 264)]  # flash: d <= 256
    assert attn_mod.cuda_varlen_usable(wide[0], True, 0.0)
    assert not attn_mod.cuda_varlen_usable(wide[1], True, 0.0)


def test_packed_documents_on_a_t4_take_the_masked_path(monkeypatch):
    """kernels.attention on a CUDA tensor (device_kind forced; the tensors stay here) of a GPU
    below sm80 never calls varlen_attn, which would refuse it, and computes the masked reference;
    on sm80 the same call takes varlen_attn."""
    import torch.nn.attention.varlen as varlen
    from kernels.dispatch import KernelPaths
    calls = []

    def counted(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                enable_gqa=False):   # torch 2.13's signature
        calls.append(window_size)
        return _varlen_semantics(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                                 window_size=window_size, enable_gqa=enable_gqa)
    monkeypatch.setattr(varlen, "varlen_attn", counted)
    monkeypatch.setattr(attn_mod, "device_kind", lambda t: "cuda")
    q, k, v = _qkv(2, 4, 4, 7, 8, seed=5, dtype=torch.float16)
    want = kernels.attention_reference(q, k, v, document_ids=DOCS)
    t4 = attn_mod.attention(q, k, v, document_ids=DOCS, cu_seqlens=CU,
                            paths=KernelPaths(cuda_capability=(7, 5)))
    assert calls == []
    _close([t4], [want], torch.float16)
    attn_mod.attention(q, k, v, document_ids=DOCS, cu_seqlens=CU, paths=KernelPaths(cuda_capability=(8, 0)))
    assert len(calls) == 1


def test_non_causal_packed_documents_on_cuda_take_the_masked_path(monkeypatch):
    import torch.nn.attention.varlen as varlen

    def refuse(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):   # torch 2.13's signature
        raise AssertionError("varlen_attn called for non-causal documents (it would run causally)")
    monkeypatch.setattr(varlen, "varlen_attn", refuse)
    monkeypatch.setattr(attn_mod, "device_kind", lambda t: "cuda")
    q, k, v = _qkv(2, 4, 2, 7, 8, seed=8, dtype=torch.float16)
    out = attn_mod.attention(q, k, v, causal=False, document_ids=DOCS, cu_seqlens=CU)
    _close([out], [_attention64(q, k, v, False, DOCS)], torch.float16)


def test_a_compiled_graph_takes_the_mask_not_the_host_lengths(monkeypatch):
    """Inside torch.compile (the eager backend: Dynamo's guards are what is tested) a CUDA call
    (device_kind forced) takes the block-diagonal mask, so four micro-batches with 2 to 5
    documents are one graph, equal to the reference; varlen_attn's host lengths would be guards
    (a graph per document count, eager past the recompile limit). Eagerly the call takes varlen."""
    import torch.nn.attention.varlen as varlen
    from torch._dynamo.utils import counters
    calls = []

    def counted(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                enable_gqa=False):   # torch 2.13's signature
        calls.append(len(cu_q))
        return _varlen_semantics(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                                 window_size=window_size, enable_gqa=enable_gqa)
    monkeypatch.setattr(varlen, "varlen_attn", counted)
    monkeypatch.setattr(attn_mod, "device_kind", lambda t: "cuda")
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, 7, 8, seed=9, dtype=torch.float16))

    def call(q, k, v, inputs):
        return attn_mod.attention(q, k, v, document_ids=inputs.document_ids,
                                  cu_seqlens=inputs.cu_seqlens) * 2
    compiled = torch.compile(call, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    for docs in ([[0] * 7, [0] * 7], [[0] * 3 + [1] * 4, [0] * 7], DOCS.tolist(),
                 [[0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1]]):
        ids = torch.tensor(docs, dtype=torch.int32)
        inputs = AttentionInputs(torch.zeros(2, 7, dtype=torch.long), ids,
                                 kernels.cu_seqlens_from_document_ids(ids))
        got = compiled(q, k, v, inputs)
        _close([got], [2 * kernels.attention_reference(q, k, v, document_ids=ids)], torch.float16)
    assert calls == [] and counters["stats"]["unique_graphs"] == 1, (calls, dict(counters["stats"]))
    call(q, k, v, inputs)
    assert calls == [6]
    torch._dynamo.reset()


# ---------------------------------------------------------------- packed-document contract


def test_cu_seqlens_must_split_at_row_ends(monkeypatch):
    """A document piece across a row end (0, 10, 14 for rows of 7) or lengths that do not rise:
    the mask path and the varlen paths would attend over different documents."""
    q, k, v = _qkv(2, 4, 2, 7, 8, dtype=torch.bfloat16)
    pos = torch.arange(7).expand(2, 7)
    for bad, says in (((0, 10, 14), "row end 7"), ((0, 4, 4, 7, 14), "strictly increasing")):
        with pytest.raises(ValueError, match=says):
            kernels.attention(q, k, v, cu_seqlens=bad)
        with pytest.raises(ValueError, match=says):
            AttentionInputs(pos, DOCS, bad)
    bad = (0, 4, 10, 14)  # with valid ids, on the paths that read cu_seqlens as given
    monkeypatch.setattr(attn_mod, "device_kind", lambda t: "cuda")
    with pytest.raises(ValueError, match="row end 7"):
        attn_mod.attention(q, k, v, document_ids=DOCS, cu_seqlens=bad)
    install_fake_npu(monkeypatch)
    with pytest.raises(ValueError, match="row end 7"):
        kernels.attention(q, k, v, document_ids=DOCS, cu_seqlens=bad)


def test_document_ids_must_be_non_decreasing():
    bad = torch.tensor([[0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    q, k, v = _qkv(2, 4, 2, 7, 8)
    says = "non-decreasing along a row: row 0 goes from 1 to 0 at token 4"
    with pytest.raises(ValueError, match=says):
        kernels.cu_seqlens_from_document_ids(bad)
    with pytest.raises(ValueError, match=says):
        AttentionInputs(torch.arange(7).expand(2, 7), bad, (0, 2, 4, 7, 9, 14))
    # the kernel does not read ids per call (a CPU run would count the read as a device's wait,
    # tests/engine/training/test_host_syncs.py): the meta device has no values at all
    meta = kernels.attention(*(t.detach().to("meta") for t in (q, k, v)), document_ids=bad.to("meta"))
    assert meta.device.type == "meta" and meta.shape == q.shape
