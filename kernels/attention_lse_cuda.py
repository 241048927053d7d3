"""Ring attention's per-block kernels on CUDA: PyTorch's flash and memory-efficient SDPA kernels,
which return the log-sum-exp that the ring's merge needs (kernels/attention_lse.py has the math).

- ``aten._scaled_dot_product_flash_attention``: compute capability 8.0 or later, fp16/bf16, head
  dim a multiple of 8 up to 256, no mask (causal blocks, and every unmasked block of the ring).
  lse (b, n, sq) fp32. Its ``is_causal`` is aligned bottom-right when the query and key lengths
  differ (FlashAttention 2's convention; SDPA's own dispatcher refuses flash for that case,
  sdp_utils.cpp ``check_flash_causal_non_square_seqlens``), so a causal block with sq != sk never
  takes it: attention_lse's causal is top-left.
- ``aten._scaled_dot_product_efficient_attention``: compute capability 5.0 or later, any of
  fp32/fp16/bf16 (bf16 from 8.0), an additive float bias (packed documents: 0 where attended, -inf
  where masked), head dim a multiple of 8; ``is_causal`` top-left (``CausalFromTopLeft``) for any
  lengths. Its lse is padded along the queries to a multiple of 32 (``LSE_ALIGN``); the bias's last
  dimension must be 16-element aligned in memory, so it is allocated padded and viewed
  (``BIAS_ALIGN``).

Both backwards recompute P = exp(S - lse) from the lse they are given and take
rowsum(dO * out) from the out they are given, so the ring passes the MERGED out and lse, as on the
CPU and NPU paths. Neither kernel takes fewer key/value heads: those are repeated for the call and
their gradients summed over each group afterwards. A shape or dtype neither kernel takes
(``cuda_block_kernel`` returns None) runs the fp32 blockwise path. Outputs are read by position,
since their names changed between torch releases (rng_state / philox_seed).

The compute capability comes down from the engine (``DeviceInfo.capability`` ->
``KernelPaths.cuda_capability``; the kernels never ask the GPU). PyTorch's flash_api.cpp ``mha_fwd``
and ``mha_bwd`` both ``TORCH_CHECK(is_sm80_or_newer, "FlashAttention only supports Ampere GPUs or
newer.")`` (``is_sm80_or_newer = major * 10 >= 80``): called directly, flash raises on a V100 (7.0)
or T4 (7.5), where SDPA's own dispatcher (the layer's plain attention) falls back by itself, so
below 8.0 the blocks take efficient attention. Its kernels (mem_eff_attention/kernels/cutlassF.h,
cutlassB.h) cover fp16 and fp32 from 5.0 but bf16 from 8.0 only (else "cutlassF: no kernel found to
launch!"): a bf16 block below 8.0 runs blockwise. Capability None (not told) counts as 8.0 or
later, as ``ALL_FUSED`` counts every fused op as there.
"""
from __future__ import annotations

import torch

LSE_ALIGN = 32    # efficient attention's lse: (b, n, ceil(sq / 32) * 32)
BIAS_ALIGN = 16   # efficient attention's bias: last-dimension stride a multiple of 16 elements
FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EFFICIENT_DTYPES_BEFORE_SM80 = (torch.float16, torch.float32)   # no bf16 kernels below 8.0
MAX_FLASH_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)   # flash_api.cpp: is_sm80_or_newer, forward and backward


def cuda_ops() -> dict:
    """The installed torch's CUDA SDPA kernels that return the lse ({} where none)."""
    names = {"flash": "_scaled_dot_product_flash_attention",
             "flash_backward": "_scaled_dot_product_flash_attention_backward",
             "efficient": "_scaled_dot_product_efficient_attention",
             "efficient_backward": "_scaled_dot_product_efficient_attention_backward"}
    return {key: op for key, name in names.items()
            if (op := getattr(torch.ops.aten, name, None)) is not None}


def flash_capable(capability: tuple | None) -> bool:
    """Whether PyTorch's flash kernels run on a GPU of compute ``capability`` (8.0 or later; None,
    not told, counts as such)."""
    return capability is None or tuple(capability) >= FLASH_MIN_CAPABILITY


def cuda_block_kernel(q: torch.Tensor, mask, ops: dict, capability: tuple | None = None,
                      causal: bool = False, sk: int | None = None) -> str | None:
    """'flash', 'efficient' or None (the blockwise path) for one block of q (b, n, sq, d) against
    ``sk`` keys (None: sq) on a GPU of compute ``capability`` (major, minor; None: not told, counted
    as 8.0 or later). A causal block with sq != sk never takes flash (bottom-right causal there)."""
    d = q.shape[-1]
    if d % 8:
        return None
    sm80 = flash_capable(capability)
    top_left = not causal or sk is None or sk == q.shape[2]  # flash's causal means the same
    if (sm80 and mask is None and top_left and q.dtype in FLASH_DTYPES and d <= MAX_FLASH_HEAD_DIM
            and "flash" in ops and "flash_backward" in ops):
        return "flash"
    dtypes = EFFICIENT_DTYPES if sm80 else EFFICIENT_DTYPES_BEFORE_SM80
    if q.dtype in dtypes and "efficient" in ops and "efficient_backward" in ops:
        return "efficient"
    return None


def _repeat_kv(q, k, v):
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k.contiguous(), v.contiguous()
    return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, n, s, d) gradient of repeated key/value heads -> (b, n_kv, s, d)."""
    b, n, s, d = grad.shape
    if n == kv_heads:
        return grad
    return grad.view(b, kv_heads, n // kv_heads, s, d).sum(2)


def _bias(mask, q: torch.Tensor) -> torch.Tensor | None:
    """(b, 1, sq, sk) bool (True = masked) -> (b, n, sq, sk) additive bias of q's dtype, its last
    dimension laid out padded to BIAS_ALIGN elements."""
    if mask is None:
        return None
    b, _, sq, sk = mask.shape
    padded = -(-sk // BIAS_ALIGN) * BIAS_ALIGN
    bias = torch.zeros(b, 1, sq, padded, dtype=q.dtype, device=q.device)[..., :sk]
    bias.masked_fill_(mask, float("-inf"))
    return bias.expand(b, q.shape[1], sq, sk)


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """(b, n, sq) -> (b, n, ceil(sq / LSE_ALIGN) * LSE_ALIGN) fp32, the layout efficient attention
    returns and its backward reads."""
    sq = lse.shape[-1]
    out = torch.zeros(*lse.shape[:-1], -(-sq // LSE_ALIGN) * LSE_ALIGN, dtype=torch.float32,
                      device=lse.device)
    out[..., :sq] = lse
    return out


def cuda_forward(kernel: str, ops: dict, q, k, v, causal: bool, mask, scale: float):
    """(out (b, n, sq, d) in q's dtype, lse (b, n, sq) fp32) of q against one key/value block."""
    q = q.contiguous()
    kr, vr = _repeat_kv(q, k, v)
    if kernel == "flash":
        res = ops["flash"](q, kr, vr, 0.0, causal, False, scale=scale)
        return res[0], res[1].float()
    res = ops["efficient"](q, kr, vr, _bias(mask, q), True, 0.0, causal, scale=scale)
    return res[0], res[1][..., :q.shape[2]].float()


def cuda_backward(kernel: str, ops: dict, dout, q, k, v, out, lse, causal: bool, mask,
                  scale: float):
    """(dq, dk, dv) of one block given the merged out and lse (fully masked queries: lse -inf)."""
    q, dout = q.contiguous(), dout.contiguous()
    out = out.to(q.dtype).contiguous()
    kr, vr = _repeat_kv(q, k, v)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).float().contiguous()
    sq = q.shape[2]
    if kernel == "flash":
        # not varlen: no cumulative lengths (None, as the forward returns them); no dropout: the
        # philox state is not read (the forward's own are empty host tensors)
        rng = torch.empty((), dtype=torch.int64)
        dq, dk, dv = ops["flash_backward"](dout, q, kr, vr, out, safe, None, None, sq, kr.shape[2],
                                           0.0, causal, rng, rng, scale=scale)
    else:
        bias = _bias(mask, q)
        rng = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = ops["efficient_backward"](
            dout, q, kr, vr, bias, out, _padded_lse(safe), rng, rng, 0.0,
            [True, True, True, False], causal, scale=scale)
    return dq, _sum_groups(dk, k.shape[1]), _sum_groups(dv, v.shape[1])
