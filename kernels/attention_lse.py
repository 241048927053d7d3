"""Attention over one block of keys that also returns each query's log-sum-exp, forward and backward:
the per-block math of ring attention (context parallelism), where a rank attends its queries to one
key/value block after another and merges the partial results.

For a block, with scores S = Q K^T * scale and masked scores at -inf::

    lse_i = log sum_j exp(S_ij)          out_i = sum_j exp(S_ij - lse_i) V_j

Two partial results over disjoint key sets merge exactly (``merge_partial``)::

    lse = logaddexp(lse_a, lse_b)        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

and the gradient of the merged attention with respect to one block's q, k, v is that block's
flash-attention backward evaluated with the MERGED out and lse (P_ij = exp(S_ij - lse_i),
dS = P * (dO V^T - rowsum(dO * out))), so a ring's backward visits the blocks again and sums.

Paths (one dispatch, on the tensors' device):

- NPU: ``torch_npu.npu_fusion_attention`` (BNSD/BSND) returns ``softmax_max`` and ``softmax_sum``
  ((b, n, s, 8), the value repeated 8 times); lse = max + log(sum). Backward:
  ``npu_fusion_attention_grad`` with ``attention_in`` = the merged out and the merged statistics
  passed as ``softmax_max = lse``, ``softmax_sum = 1`` (the kernel recomputes
  P = exp(S - max) / sum, which is then exp(S - lse)). Causal blocks use sparse_mode 2 with the
  compressed mask, document masks an explicit (b, 1, sq, sk) mask with sparse_mode 0.
  Only where the chip table lists the op (``KernelPaths.fusion_attention``; not on the Atlas
  training series 910A / 910ProB): elsewhere an NPU runs the blockwise path, as the layer's own
  attention runs SDPA there.
- CUDA: PyTorch's flash or memory-efficient SDPA kernels, which return the log-sum-exp
  (kernels/attention_lse_cuda.py); flash never for a causal block with sq != sk (its causal is
  bottom-right there); shapes neither takes run the blockwise path.
- CPU (and the meta device): ATen's flash-attention kernel for CPU
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which returns the log-sum-exp
  and takes fewer key/value heads; it has CPU and Meta kernels only.
- Anything else (xpu, mps, ...: device types without a path of their own): ``attention_lse_blockwise``,
  plain math in fp32 tiled over the queries (key/value heads shared by query groups through
  broadcasting, never repeated in memory).
- ``attention_lse_reference``: the whole formula in fp32 at once, the yardstick for tests.

Masks: ``causal`` is top-left causal (query i sees keys 0..i; the blocks that need it are square);
``mask`` (b, 1, sq, sk) bool, True where a score is masked out (packed documents). A query whose
every key is masked gets lse = -inf and out = 0 on every path, so it drops out of the merge.
"""

from __future__ import annotations

import torch

from kernels.attention import (NPU_SPARSE_MODE_DEFAULT, NPU_SPARSE_MODE_LEFT_UP_CAUSAL,
                               NpuMaskCache, causal_mask, npu_attention_layout,
                               npu_compressed_causal_mask, resolve_scale)
from kernels.attention_lse_cuda import cuda_backward, cuda_block_kernel, cuda_forward, cuda_ops
from kernels.dispatch import KernelPaths, device_kind, import_torch_npu

NPU_SOFTMAX_REPEAT = 8  # npu_fusion_attention's softmax_max / softmax_sum: (b, n, s, 8)
TILE_ELEMENTS = 2 ** 24  # scores per tile of the blockwise path (64 MB in fp32)


def _check(q, k, v, mask) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"attention_lse expects q (b, n, sq, d) and k, v (b, n_kv, sk, d) of equal "
                         f"shapes; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, n, sq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or n % k.shape[1]:
        raise ValueError(f"k and v must share q's batch and head_dim with a number of heads dividing "
                         f"q's; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if mask is not None and tuple(mask.shape) != (b, 1, sq, k.shape[2]):
        raise ValueError(f"mask must be (b, 1, sq, sk) = ({b}, 1, {sq}, {k.shape[2]}), got "
                         f"{tuple(mask.shape)}")


def _empty_rows(mask, causal: bool) -> torch.Tensor | None:
    """(b, 1, sq) True for queries whose every key is masked (None: there are none)."""
    if mask is None:
        return None
    if causal:
        mask = mask | causal_mask(mask.shape[2], mask.shape[3], mask.device)
    return mask.all(-1)


def _fix_empty(out, lse, empty):
    """lse = -inf and out = 0 for fully masked queries, whatever a kernel left there."""
    if empty is None:
        return out, lse
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


def merge_partial(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attention results over disjoint keys (out (b, n, s, d) fp32, lse
    (b, n, s) fp32); a query with lse = -inf on both sides stays (0, -inf)."""
    merged = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    wa, wb = torch.exp(lse - safe), torch.exp(lse_b - safe)  # exp(-inf) = 0
    return out * wa.unsqueeze(-1) + out_b.float() * wb.unsqueeze(-1), merged


# ---- the reference -----------------------------------------------------------------------------

def _full_mask(sq, sk, causal, mask, device):
    m = causal_mask(sq, sk, device) if causal else None
    if mask is not None:
        m = mask if m is None else (mask | m)
    return m


def attention_lse_reference(q, k, v, causal: bool = False, mask=None, scale=None):
    """(out in q's dtype, lse fp32 (b, n, sq)) of softmax(Q K^T * scale + mask) V, in fp32 at once;
    fewer key/value heads are repeated."""
    _check(q, k, v, mask)
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = q.float() @ kf.transpose(-2, -1) * resolve_scale(scale, q.shape[-1])
    m = _full_mask(q.shape[2], k.shape[2], causal, mask, q.device)
    if m is not None:
        scores = scores.masked_fill(m, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # (b, n, sq)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(scores - safe.unsqueeze(-1)) @ vf
    return out.to(q.dtype), lse


# ---- the blockwise plain-math path (CUDA, and CPU without ATen's kernel) -----------------------

def _tiles(q, k):
    b, n, sq, _ = q.shape
    rows = max(1, TILE_ELEMENTS // max(1, b * n * k.shape[2]))
    return [(i, min(sq, i + rows)) for i in range(0, sq, rows)]


def _tile_scores(qg, kg, i0, i1, causal, mask, scale):
    """Scores (b, G, r, t, sk) fp32 of query rows i0:i1, masked at -inf."""
    s = qg[:, :, :, i0:i1] @ kg.transpose(-2, -1) * scale
    sk = kg.shape[-2]
    if causal:
        masked = torch.arange(sk, device=s.device)[None, :] > torch.arange(i0, i1, device=s.device)[:, None]
        s = s.masked_fill(masked, float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask[:, :, None, i0:i1], float("-inf"))  # (b, 1, 1, t, sk)
    return s


def _grouped(q, k, v):
    b, n, sq, d = q.shape
    g = k.shape[1]
    return (q.float().view(b, g, n // g, sq, d), k.float().unsqueeze(2), v.float().unsqueeze(2))


def attention_lse_blockwise(q, k, v, causal: bool = False, mask=None, scale=None):
    """Plain math in fp32, tiled over the queries so no more than TILE_ELEMENTS scores exist at once."""
    _check(q, k, v, mask)
    b, n, sq, d = q.shape
    scale = resolve_scale(scale, d)
    qg, kg, vg = _grouped(q, k, v)
    out = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=torch.float32, device=q.device)
    for i0, i1 in _tiles(q, k):
        s = _tile_scores(qg, kg, i0, i1, causal, mask, scale)
        tl = torch.logsumexp(s, -1)
        safe = torch.where(torch.isinf(tl), torch.zeros_like(tl), tl)
        out[:, :, :, i0:i1] = torch.exp(s - safe.unsqueeze(-1)) @ vg
        lse[:, :, :, i0:i1] = tl
    return out.view(b, n, sq, d).to(q.dtype), lse.view(b, n, sq)


def attention_lse_blockwise_backward(dout, q, k, v, out, lse, causal: bool = False, mask=None,
                                     scale=None):
    """Gradients of one block given the merged ``out`` and ``lse`` (see the module docstring)."""
    b, n, sq, d = q.shape
    g = k.shape[1]
    scale = resolve_scale(scale, d)
    qg, kg, vg = _grouped(q, k, v)
    dog = dout.float().view(b, g, n // g, sq, d)
    delta = (dog * out.float().view(b, g, n // g, sq, d)).sum(-1, keepdim=True)  # (b, G, r, sq, 1)
    lg = lse.float().view(b, g, n // g, sq, 1)
    lg = torch.where(torch.isinf(lg), torch.zeros_like(lg), lg)
    dq = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, g, k.shape[2], d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for i0, i1 in _tiles(q, k):
        p = torch.exp(_tile_scores(qg, kg, i0, i1, causal, mask, scale) - lg[:, :, :, i0:i1])
        do = dog[:, :, :, i0:i1]
        dv += (p.transpose(-2, -1) @ do).sum(2)
        ds = p * (do @ vg.transpose(-2, -1) - delta[:, :, :, i0:i1])
        dq[:, :, :, i0:i1] = ds @ kg * scale
        dk += (ds.transpose(-2, -1) @ qg[:, :, :, i0:i1]).sum(2) * scale
    return dq.view(b, n, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- CPU: ATen's flash kernel ----------------------------------------------------------------

def _aten_cpu_ops():
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return (fwd, bwd) if fwd is not None and bwd is not None else None


def _additive(mask, dtype):
    """ATen's CPU kernel takes a float mask of q's dtype: 0 where attended, -inf where masked."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        mask, float("-inf"))


def _cpu_forward(ops, q, k, v, causal, mask, scale):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = ops[0](q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    return out, lse.float()


def _cpu_backward(ops, dout, q, k, v, out, lse, causal, mask, scale):
    c = [t.contiguous() for t in (dout, q, k, v, out)]
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # fully masked: P = exp(-inf) = 0
    return ops[1](*c, lse.contiguous(), 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)


# ---- NPU: npu_fusion_attention with its softmax statistics --------------------------------------

def npu_block_kwargs(q, causal: bool, mask, scale, mask_cache: NpuMaskCache | None = None) -> dict:
    """Keyword arguments of npu_fusion_attention (and, with ``scale_value``, of its grad) for one
    block: causal -> sparse_mode 2 with the compressed 2048 mask; a document mask -> sparse_mode 0
    with the explicit (b, 1, sq, sk) bool mask (True = masked), the causal triangle folded in and
    the band said to match (``next_tockens`` 0, ``pre_tockens`` sk: op-plugin's
    torch_npu-npu_fusion_attention.md, sparse_mode 0 needs atten_mask and pre/next_tockens to
    agree, "next_tockens取值为0，pre_tockens大于等于Sq" for the causal case)."""
    band = {}
    if mask is not None:
        if causal:
            mask = mask | causal_mask(mask.shape[2], mask.shape[3], mask.device)
            band = {"pre_tockens": mask.shape[3], "next_tockens": 0}
        atten, mode = mask, NPU_SPARSE_MODE_DEFAULT
    elif causal:
        atten = mask_cache.get(q.device) if mask_cache is not None else npu_compressed_causal_mask(q.device)
        mode = NPU_SPARSE_MODE_LEFT_UP_CAUSAL
    else:
        atten, mode = None, NPU_SPARSE_MODE_DEFAULT
    return {"atten_mask": atten, "scale": resolve_scale(scale, q.shape[3]), "keep_prob": 1.0,
            "sparse_mode": mode, **band}


def npu_lse(softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> torch.Tensor:
    """(b, n, s, 8) statistics -> lse (b, n, s) fp32 = max + log(sum)."""
    return softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())


def npu_statistics(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lse (b, n, s) -> (softmax_max, softmax_sum) (b, n, s, 8) fp32 that npu_fusion_attention_grad
    reads as P = exp(S - max) / sum = exp(S - lse). Fully masked queries (lse = -inf) get max 0
    (no score survives their mask)."""
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).float()
    shape = (*lse.shape, NPU_SOFTMAX_REPEAT)
    return safe.unsqueeze(-1).expand(shape).contiguous(), torch.ones(shape, dtype=torch.float32,
                                                                       device=lse.device)


def _to_layout(t, layout):
    return t.transpose(1, 2).contiguous() if layout == "BSND" else t.contiguous()


def _npu_forward(q, k, v, causal, mask, scale, mask_cache):
    torch_npu = import_torch_npu()
    layout, qx, kx, vx = npu_attention_layout(q, k, v)
    result = torch_npu.npu_fusion_attention(qx, kx, vx, q.shape[1], layout,
                                            **npu_block_kwargs(q, causal, mask, scale, mask_cache))
    out = result[0].transpose(1, 2) if layout == "BSND" else result[0]
    return out, npu_lse(result[1], result[2])


def _npu_backward(dout, q, k, v, out, lse, causal, mask, scale, mask_cache):
    torch_npu = import_torch_npu()
    layout, qx, kx, vx = npu_attention_layout(q, k, v)
    kwargs = npu_block_kwargs(q, causal, mask, scale, mask_cache)
    kwargs["scale_value"] = kwargs.pop("scale")
    smax, ssum = npu_statistics(lse)
    grads = torch_npu.npu_fusion_attention_grad(
        qx, kx, vx, _to_layout(dout, layout), q.shape[1], layout, softmax_max=smax,
        softmax_sum=ssum, attention_in=_to_layout(out, layout), **kwargs)
    dq, dk, dv = grads[:3]
    if layout == "BSND":
        dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    return dq, dk, dv


# ---- dispatch ----------------------------------------------------------------------------------

def block_path(q: torch.Tensor, mask=None, paths: KernelPaths | None = None,
               causal: bool = False, sk: int | None = None) -> str:
    """Which kernel runs a block of q against ``sk`` keys (None: as many as queries): 'npu',
    'cuda-flash', 'cuda-efficient', 'cpu-flash' or 'blockwise'. ``paths``: the chip's fused ops
    (None: all)."""
    kind = device_kind(q)
    if kind == "npu":
        return "npu" if paths is None or paths.fusion_attention else "blockwise"
    if kind == "cuda":
        kernel = cuda_block_kernel(q, mask, cuda_ops(),
                                   None if paths is None else paths.cuda_capability, causal, sk)
        return "blockwise" if kernel is None else f"cuda-{kernel}"
    # ATen's CPU op has CPU and Meta kernels only: every other device type runs the plain math
    if q.device.type in ("cpu", "meta") and _aten_cpu_ops() is not None:
        return "cpu-flash"
    return "blockwise"


def attention_lse(q, k, v, causal: bool = False, mask=None, scale=None, *,
                  mask_cache: NpuMaskCache | None = None, paths: KernelPaths | None = None):
    """(out (b, n, sq, d) in q's dtype, lse (b, n, sq) fp32) of q against one key/value block."""
    _check(q, k, v, mask)
    scale = resolve_scale(scale, q.shape[-1])
    path = block_path(q, mask, paths, causal, k.shape[2])
    if path == "npu":
        out, lse = _npu_forward(q, k, v, causal, mask, scale, mask_cache)
    elif path.startswith("cuda-"):
        out, lse = cuda_forward(path[5:], cuda_ops(), q, k, v, causal, mask, scale)
    elif path == "cpu-flash":
        out, lse = _cpu_forward(_aten_cpu_ops(), q, k, v, causal, mask, scale)
    else:
        return attention_lse_blockwise(q, k, v, causal, mask, scale)
    return _fix_empty(out, lse, _empty_rows(mask, causal))


def attention_lse_backward(dout, q, k, v, out, lse, causal: bool = False, mask=None, scale=None, *,
                           mask_cache: NpuMaskCache | None = None,
                           paths: KernelPaths | None = None):
    """(dq, dk, dv) of one block, given the MERGED out and lse of the queries over all blocks."""
    _check(q, k, v, mask)
    scale = resolve_scale(scale, q.shape[-1])
    path = block_path(q, mask, paths, causal, k.shape[2])
    if path == "npu":
        return _npu_backward(dout, q, k, v, out, lse, causal, mask, scale, mask_cache)
    if path.startswith("cuda-"):
        return cuda_backward(path[5:], cuda_ops(), dout, q, k, v, out, lse, causal, mask, scale)
    if path == "cpu-flash":
        return _cpu_backward(_aten_cpu_ops(), dout, q, k, v, out, lse, causal, mask, scale)
    return attention_lse_blockwise_backward(dout, q, k, v, out, lse, causal, mask, scale)
