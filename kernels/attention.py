"""Scaled dot-product attention: one call, three device paths, one plain-math reference.

- NPU: ``torch_npu.npu_fusion_attention`` (flash-style fused kernel with its own backward); packed
  documents in its TND layout with ``actual_seq_qlen`` / ``actual_seq_kvlen``.
- CUDA and CPU: ``F.scaled_dot_product_attention``, which picks flash / memory-efficient / math
  backends itself; packed documents as a block-diagonal causal mask, or on CUDA in half precision
  and outside a compiled graph ``torch.nn.attention.varlen.varlen_attn`` over the same cumulative
  lengths (host ints, which torch.compile would guard on: a compiled graph takes the mask).
- ``attention_reference``: softmax(Q K^T * scale + mask) V in fp32, the yardstick for tests.

Grouped-query attention: k and v may carry fewer heads than q (n_kv dividing n); query head i reads
key/value head i // (n / n_kv). No path materialises repeated key/value heads: SDPA gets
``enable_gqa=True``, npu_fusion_attention and varlen_attn take fewer KV heads as documented.

Packed documents: ``document_ids`` (b, s) restricts query i to keys j of its own document (j <= i);
``cu_seqlens`` (host ints, leading 0) are the cumulative lengths of the document pieces over the
flattened b * s tokens, which varlen kernels take. Callers that hold both pass both; either one
alone is derived from the other. Both are checked where their values are already on the host, so
that no check waits on a device: ``cu_seqlens`` (strictly increasing, every row end a boundary)
wherever it is read, ``document_ids`` (non-decreasing along a row) when it is a CPU tensor outside
a compiled graph and wherever it is read on the host (``cu_seqlens_from_document_ids``).

Causality is top-left aligned everywhere (query i sees keys 0..i), which is what SDPA's
``is_causal`` and npu_fusion_attention's ``sparse_mode=2`` (leftUpCausal) both mean; it equals the
usual causal mask when query and key lengths agree.

The NPU call's argument preparation (mask, layout, scale, keep_prob, output unpacking) lives in plain
functions so that it is tested on machines without an NPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.attention_lse_cuda import flash_capable
from kernels.dispatch import KernelPaths, device_kind, import_torch_npu
from kernels.documents import (check_cu_seqlens, cu_seqlens_from_document_ids,
                               document_ids_from_cu_seqlens)
from kernels.signatures import accepts, keyword_names

# npu_fusion_attention's causal sparse modes (2 = leftUpCausal) take this fixed "compressed" lower
# triangle instead of an (s, s) mask, for every sequence length.
NPU_COMPRESSED_MASK_SIZE = 2048
NPU_SPARSE_MODE_DEFAULT = 0  # atten_mask used as given (or no mask)
NPU_SPARSE_MODE_LEFT_UP_CAUSAL = 2
# Packed documents (TND layout): each document is causal from its own bottom-right corner
# (rightDownCausal), with the same compressed mask; equal to top-left causal because every document's
# query and key lengths agree. It is also the mode that sparse_mode 7 (a query sequence split across
# devices) is documented relative to.
NPU_SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
# npu_fusion_attention's documented limit on len(actual_seq_qlen) in the varlen (TND) case
NPU_VARLEN_MAX_SEGMENTS = 1024
# flash-attention's head_dim limits for torch.nn.attention.varlen (multiple of 8, at most 256)
VARLEN_HEAD_DIM_MULTIPLE, VARLEN_MAX_HEAD_DIM = 8, 256


def causal_mask(sq: int, skv: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(sq, skv) bool mask, True where a score is masked out (key j is after query i)."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).triu(diagonal=1)


def document_mask(document_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(b, 1, s, s) bool mask from per-token document ids (b, s), True where a score is masked out:
    key j is in another document than query i, or (causal) after it."""
    masked = document_ids[:, :, None] != document_ids[:, None, :]  # (b, s, s)
    if causal:
        s = document_ids.shape[1]
        masked = masked | causal_mask(s, s, document_ids.device)
    return masked.unsqueeze(1)


def npu_compressed_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The 2048 x 2048 mask that npu_fusion_attention documents for sparse_mode 2 (True = masked)."""
    return causal_mask(NPU_COMPRESSED_MASK_SIZE, NPU_COMPRESSED_MASK_SIZE, device)


class NpuMaskCache:
    """Holds one compressed causal mask per device so repeated attention calls reuse it, and the
    device copy of the last packed-document lengths (``cu_seqlens_on``).

    The mask is independent of the sequence length (sparse_mode 2 uses the compressed form), so the
    key is the device alone. Owned by whoever calls ``attention`` (a model or block), never global.
    """

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._cu: tuple = (None, None, None)  # (host cu_seqlens, device, its int32 device copy)

    def cu_seqlens_on(self, cu_seqlens, device: torch.device) -> torch.Tensor:
        """``cu_seqlens`` as an int32 tensor on ``device``, copied once per micro-batch: every layer
        of a micro-batch passes the same host tuple, which is copied from pinned memory without
        blocking the host (a pageable copy per layer would synchronize the stream each time)."""
        key, dev, tensor = self._cu
        if key is not cu_seqlens or dev != device:
            host = torch.tensor(cu_seqlens, dtype=torch.int32)
            if device.type in ("cuda", "npu"):
                host = host.pin_memory()
            tensor = host.to(device, non_blocking=True)
            self._cu = (cu_seqlens, device, tensor)
        return tensor

    def get(self, device: torch.device | str) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._masks:
            self._masks[device] = npu_compressed_causal_mask(device)
        return self._masks[device]

    def __len__(self) -> int:
        return len(self._masks)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: the given one, or 1/sqrt(head_dim) (npu_fusion_attention defaults to 1.0)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               document_ids: torch.Tensor | None = None, cu_seqlens=None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q, k, v of shape (b, n_heads, s, d); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, n, sq, d = q.shape
    n_kv = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or v.shape != k.shape or n_kv < 1 or n % n_kv:
        raise ValueError(
            f"k and v must share q's batch and head_dim, have equal shapes, and a number of heads "
            f"dividing q's (grouped-query attention); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}; pass 0.0 in evaluation")
    if document_ids is not None or cu_seqlens is not None:
        if k.shape[2] != sq:
            raise ValueError(f"packed documents need equal query and key lengths, got {sq} and {k.shape[2]}")
        if document_ids is not None and tuple(document_ids.shape) != (b, sq):
            raise ValueError(f"document_ids must be (b, s) = ({b}, {sq}), got {tuple(document_ids.shape)}")
        # (ids are checked where the batch is built, models.AttentionInputs, not per call: on a
        # CPU run a per-call read would count as the host wait it would be on a device)
        # (cu_seqlens is read only where a kernel takes it, so that torch.compile does not
        # specialise the mask path on the segment list: here when it alone describes the documents)
        if document_ids is None:
            check_cu_seqlens(cu_seqlens, b, sq)


def npu_attention_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick npu_fusion_attention's input_layout so no copy is made when one can be avoided.

    q, k, v are logically (b, n, s, d). If their memory is already BNSD they go as they are; if they
    are transposed views of contiguous (b, s, n, d) tensors (the usual result of splitting heads off
    a (b, s, h) projection) they go as "BSND" views, saving two copies forward and backward. Anything
    else is made contiguous in BNSD.
    """
    if all(t.is_contiguous() for t in (q, k, v)):
        return "BNSD", q, k, v
    bsnd = [t.transpose(1, 2) for t in (q, k, v)]  # (b, s, n, d) views
    if all(t.is_contiguous() for t in bsnd):
        return "BSND", bsnd[0], bsnd[1], bsnd[2]
    return "BNSD", q.contiguous(), k.contiguous(), v.contiguous()


def npu_fusion_attention_kwargs(
    q: torch.Tensor,
    causal: bool,
    dropout_p: float,
    scale: float | None,
    mask_cache: NpuMaskCache | None = None,
) -> dict:
    """Keyword arguments for torch_npu.npu_fusion_attention.

    head_num and input_layout go positionally, as in the documented examples: head_num is q's
    n_heads (dim 1 of the logical BNSD shape) and the layout comes from ``npu_attention_layout``.
    """
    head_dim = q.shape[3]
    if causal:
        mask = mask_cache.get(q.device) if mask_cache is not None else npu_compressed_causal_mask(q.device)
        sparse_mode = NPU_SPARSE_MODE_LEFT_UP_CAUSAL
    else:
        mask, sparse_mode = None, NPU_SPARSE_MODE_DEFAULT
    return {
        "atten_mask": mask,
        "scale": resolve_scale(scale, head_dim),
        "keep_prob": 1.0 - dropout_p,
        "sparse_mode": sparse_mode,
    }


def unpack_fusion_attention_output(result, layout: str) -> torch.Tensor:
    """npu_fusion_attention returns (out, softmax_max, softmax_sum, softmax_in, seed, offset, numel);
    keep the output and give it back as (b, n, s, d) whatever layout it was computed in."""
    out = result[0]
    return out.transpose(1, 2) if layout == "BSND" else out


def to_tnd(t: torch.Tensor) -> torch.Tensor:
    """(b, n, s, d) -> (b*s, n, d), the token-major TND layout of varlen kernels: a view when t is a
    transposed view of (b, s, ...) memory, else one copy. The view is strided unless that memory is
    (b, s, n, d) itself: k and v split off the fused QKV projection (models/layers.py split_qkv) keep
    its row stride (n + 2G) d / tp and head stride (q_per_group + 2) d."""
    b, n, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, n, d)


def from_tnd(out: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """(b*s, n, d) -> logical (b, n, s, d), a view."""
    return out.view(b, s, *out.shape[1:]).transpose(1, 2)


def npu_varlen_kwargs(q: torch.Tensor, cu_seqlens, causal: bool, dropout_p: float,
                      scale: float | None, mask_cache: NpuMaskCache | None = None) -> dict:
    """Keyword arguments for npu_fusion_attention in the TND (varlen) layout: actual_seq_qlen and
    actual_seq_kvlen are the documented cumulative lengths without the leading 0 (lengths 2 2 2 ->
    2 4 6); causal documents use rightDownCausal (sparse_mode 3) with the compressed 2048 mask,
    non-causal ones sparse_mode 0 without a mask."""
    segments = len(cu_seqlens) - 1
    if segments > NPU_VARLEN_MAX_SEGMENTS:
        raise ValueError(f"npu_fusion_attention's TND layout takes at most {NPU_VARLEN_MAX_SEGMENTS} "
                         f"document pieces per call, this micro-batch has {segments}: lower "
                         f"--micro-batch-size")
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2])
    ends = [int(c) for c in cu_seqlens[1:]]
    if causal:
        mask = mask_cache.get(q.device) if mask_cache is not None else npu_compressed_causal_mask(q.device)
        sparse_mode = NPU_SPARSE_MODE_RIGHT_DOWN_CAUSAL
    else:
        mask, sparse_mode = None, NPU_SPARSE_MODE_DEFAULT
    return {"atten_mask": mask, "scale": resolve_scale(scale, q.shape[3]), "keep_prob": 1.0 - dropout_p,
            "sparse_mode": sparse_mode, "actual_seq_qlen": ends, "actual_seq_kvlen": list(ends)}


def _attention_npu(q, k, v, causal, dropout_p, scale, mask_cache, document_ids, cu_seqlens):
    torch_npu = import_torch_npu()
    if document_ids is not None or cu_seqlens is not None:
        if cu_seqlens is None:
            cu_seqlens = cu_seqlens_from_document_ids(document_ids)
        kwargs = npu_varlen_kwargs(q, cu_seqlens, causal, dropout_p, scale, mask_cache)
        # contiguous TND, as the BNSD/BSND branch hands the op contiguous tensors: k and v split off
        # the fused QKV projection are strided views (one copy each; q too where split_qkv returns
        # it as a view, G = 1 or G = n), a tensor already contiguous in TND goes as it is
        qt, kt, vt = (to_tnd(t).contiguous() for t in (q, k, v))  # (b*s, n or n_kv, d)
        result = torch_npu.npu_fusion_attention(qt, kt, vt, q.shape[1], "TND", **kwargs)
        return from_tnd(result[0], q.shape[0], q.shape[2])
    layout, qx, kx, vx = npu_attention_layout(q, k, v)
    kwargs = npu_fusion_attention_kwargs(q, causal, dropout_p, scale, mask_cache)
    result = torch_npu.npu_fusion_attention(qx, kx, vx, q.shape[1], layout, **kwargs)
    return unpack_fusion_attention_output(result, layout)


def cuda_varlen_usable(q: torch.Tensor, causal: bool, dropout_p: float,
                       capability: tuple | None = None) -> bool:
    """Whether torch.nn.attention.varlen.varlen_attn (flash attention, CUDA only) serves this call:
    half precision, no dropout (it has none), causal, a head_dim flash attention takes, on a GPU
    of compute capability 8.0 or later (flash_api.cpp refuses older ones: a V100 or T4 takes the
    masked SDPA path instead). ``capability`` None (not told) counts as 8.0 or later, as ring
    attention's block kernels count it (kernels/attention_lse_cuda.py)."""
    d = q.shape[3]
    return (flash_capable(capability) and causal and dropout_p == 0.0 and q.dtype in (torch.float16, torch.bfloat16)
            and d % VARLEN_HEAD_DIM_MULTIPLE == 0 and d <= VARLEN_MAX_HEAD_DIM)


def cuda_varlen_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                     scale: float | None, varlen=None,
                     cache: NpuMaskCache | None = None) -> tuple[tuple, dict] | None:
    """(args, kwargs) for ``varlen``'s call (torch.nn.attention.varlen.varlen_attn when None): TND
    tensors, int32 cumulative lengths (N + 1,) on q's device for queries and keys alike, the
    longest segment; causal as ``window_size=(-1, 0)`` where it takes that keyword, else
    ``is_causal=True`` (its first release); fewer key/value heads through ``enable_gqa`` where it
    takes it, else repeated. None when this signature cannot express the call (kernels/signatures.py).
    """
    if varlen is None:
        from torch.nn.attention.varlen import varlen_attn as varlen
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2])
    takes = keyword_names(varlen)
    kwargs = {}
    if "window_size" in takes:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in takes:
        kwargs["is_causal"] = True
    else:
        return None
    scale_value = resolve_scale(scale, q.shape[3])
    if "scale" in takes:
        kwargs["scale"] = scale_value
    elif scale is not None and scale != resolve_scale(None, q.shape[3]):
        return None
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in takes:
            kwargs["enable_gqa"] = True
        else:  # query head i reads key/value head i // rep
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = (cache if cache is not None else NpuMaskCache()).cu_seqlens_on(cu_seqlens, q.device)
    longest = max(int(b) - int(a) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    return (to_tnd(q), to_tnd(k), to_tnd(v), cu, cu, longest, longest), kwargs


def _attention_cuda_varlen(q, k, v, scale, cu_seqlens, cache=None) -> torch.Tensor | None:
    """The varlen kernel where this torch has one whose signature serves the call, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    call = cuda_varlen_args(q, k, v, cu_seqlens, scale, varlen_attn, cache)
    if call is None:
        return None
    args, kwargs = call
    return from_tnd(varlen_attn(*args, **kwargs), q.shape[0], q.shape[2])


def _attention_sdpa(q, k, v, causal, dropout_p, scale, document_ids):
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if accepts(F.scaled_dot_product_attention, "enable_gqa"):  # torch >= 2.5
            gqa = {"enable_gqa": True}
        else:  # query head i reads key/value head i // rep
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = resolve_scale(scale, q.shape[-1])
    if document_ids is None and q.device.type == "meta":
        # the meta device (engine/dryrun: shapes, no data) would take SDPA's math fallback, whose
        # autograd keeps the (b, n, s, s) probabilities; the flash kernel keeps q, k, v, the output
        # and the log-sum-exp, as the fused kernels of every real device do
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, causal, scale=scale)[0]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal,
                                              scale=scale, **gqa)
    allowed = ~document_mask(document_ids, causal)  # (b, 1, s, s), True = takes part
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p,
                                          scale=scale, **gqa)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    *,
    mask_cache: NpuMaskCache | None = None,
    document_ids: torch.Tensor | None = None,
    cu_seqlens=None,
    paths: KernelPaths | None = None,
) -> torch.Tensor:
    """Fused attention on q (b, n, s, d) and k, v (b, n_kv, s_kv, d), returning (b, n, s_q, d).

    ``dropout_p`` is applied whenever it is non-zero: pass 0.0 outside training. ``scale`` defaults
    to 1/sqrt(d). ``mask_cache`` only matters on NPU, where it saves rebuilding the causal mask.
    ``document_ids`` (b, s) and/or ``cu_seqlens`` (host ints) restrict attention to packed documents.
    ``paths``: the chip's fused ops (None: all); without ``fusion_attention`` an NPU runs SDPA.
    """
    _check_qkv(q, k, v, dropout_p, document_ids, cu_seqlens)
    kind = device_kind(q)
    if kind == "npu" and (paths is None or paths.fusion_attention):
        return _attention_npu(q, k, v, causal, dropout_p, scale, mask_cache, document_ids, cu_seqlens)
    packed = document_ids is not None or cu_seqlens is not None
    capability = None if paths is None else paths.cuda_capability
    # (inside a compiled graph the varlen kernel's host lengths would be guards: the graph would
    # compile again for every new document count and, past the recompile limit, run eagerly; the
    # block-diagonal mask reads only the device tensor of document ids)
    if kind == "cuda" and packed and not torch.compiler.is_compiling() \
            and cuda_varlen_usable(q, causal, dropout_p, capability):
        if cu_seqlens is None:
            cu_seqlens = cu_seqlens_from_document_ids(document_ids)
        out = _attention_cuda_varlen(q, k, v, scale, cu_seqlens, mask_cache)
        if out is not None:
            return out
    if packed and document_ids is None:
        document_ids = document_ids_from_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], q.device)
    return _attention_sdpa(q, k, v, causal, dropout_p, scale, document_ids)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    *,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V, computed in fp32 and cast back to q's dtype; fewer key/value
    heads are repeated, packed documents masked with ``document_mask``."""
    _check_qkv(q, k, v, dropout_p, document_ids)
    qf, kf, vf = q.float(), k.float(), v.float()
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # query head i reads key/value head i // rep
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    scores = qf @ kf.transpose(-2, -1) * resolve_scale(scale, q.shape[-1])  # (b, n, sq, skv)
    if document_ids is not None:
        scores = scores.masked_fill(document_mask(document_ids, causal), float("-inf"))
    elif causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)  # (sq, skv)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs @ vf).to(q.dtype)  # (b, n, sq, d)
