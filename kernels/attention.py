"""Scaled dot-product attention: one call, three device paths, one plain-math reference.

- NPU: ``torch_npu.npu_fusion_attention`` (flash-style fused kernel with its own backward).
- CUDA and CPU: ``F.scaled_dot_product_attention``, which picks flash / memory-efficient / math
  backends itself.
- ``attention_reference``: softmax(Q K^T * scale + mask) V in fp32, the yardstick for tests.

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

from kernels.dispatch import device_kind, import_torch_npu

# npu_fusion_attention's causal sparse modes (2 = leftUpCausal) take this fixed "compressed" lower
# triangle instead of an (s, s) mask, for every sequence length.
NPU_COMPRESSED_MASK_SIZE = 2048
NPU_SPARSE_MODE_DEFAULT = 0  # atten_mask used as given (or no mask)
NPU_SPARSE_MODE_LEFT_UP_CAUSAL = 2


def causal_mask(sq: int, skv: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(sq, skv) bool mask, True where a score is masked out (key j is after query i)."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).triu(diagonal=1)


def npu_compressed_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The 2048 x 2048 mask that npu_fusion_attention documents for sparse_mode 2 (True = masked)."""
    return causal_mask(NPU_COMPRESSED_MASK_SIZE, NPU_COMPRESSED_MASK_SIZE, device)


class NpuMaskCache:
    """Holds one compressed causal mask per device so repeated attention calls reuse it.

    The mask is independent of the sequence length (sparse_mode 2 uses the compressed form), so the
    key is the device alone. Owned by whoever calls ``attention`` (a model or block), never global.
    """

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}

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


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q, k, v of shape (b, n_heads, s, d); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, n, _, d = q.shape
    if k.shape[0] != b or k.shape[1] != n or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(
            f"k and v must share q's batch, heads and head_dim and have equal shapes; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}; pass 0.0 in evaluation")


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


def _attention_npu(q, k, v, causal, dropout_p, scale, mask_cache):
    torch_npu = import_torch_npu()
    layout, qx, kx, vx = npu_attention_layout(q, k, v)
    kwargs = npu_fusion_attention_kwargs(q, causal, dropout_p, scale, mask_cache)
    result = torch_npu.npu_fusion_attention(qx, kx, vx, q.shape[1], layout, **kwargs)
    return unpack_fusion_attention_output(result, layout)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
    *,
    mask_cache: NpuMaskCache | None = None,
) -> torch.Tensor:
    """Fused attention on (b, n_heads, s, d) tensors, returning (b, n_heads, s_q, d).

    ``dropout_p`` is applied whenever it is non-zero: pass 0.0 outside training. ``scale`` defaults
    to 1/sqrt(d). ``mask_cache`` only matters on NPU, where it saves rebuilding the causal mask.
    """
    _check_qkv(q, k, v, dropout_p)
    if device_kind(q) == "npu":
        return _attention_npu(q, k, v, causal, dropout_p, scale, mask_cache)
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, scale=resolve_scale(scale, q.shape[-1])
    )


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(Q K^T * scale + mask) V, computed in fp32 and cast back to q's dtype."""
    _check_qkv(q, k, v, dropout_p)
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = qf @ kf.transpose(-2, -1) * resolve_scale(scale, q.shape[-1])  # (b, n, sq, skv)
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)  # (sq, skv)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs @ vf).to(q.dtype)  # (b, n, sq, d)
