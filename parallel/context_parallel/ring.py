"""Ring attention (``--cp-comm-type p2p``): key/value blocks travel around the CP ring while each
rank merges the partial results of its queries with the log-sum-exp rule.

Every rank holds the load-balanced shard of sharding.py: chunks r and 2cp-1-r of the sequence, each
of c = s / (2 cp) tokens, as the two halves of its local sequence. At ring step i rank r holds the
keys and values of rank j = (r - i) mod cp and computes (kernels.attention_lse, on the block kernel of the device and chip: the NPU's fusion
attention where the chip table lists it, PyTorch's flash / memory-efficient SDPA kernels on CUDA,
ATen's CPU flash kernel):

    step 0 (j = r):  all its queries against its own keys, causal               2c x 2c, half masked
    j < r:           all its queries against j's FIRST half (chunk j), unmasked   2c x c
    j > r:           its SECOND half (chunk 2cp-1-r) against all of j's keys     c x 2c

(chunk j precedes both of r's chunks when j < r, and j's second chunk 2cp-1-j follows both of them;
when j > r both of j's chunks follow chunk r and precede chunk 2cp-1-r), so every step past the first
costs every rank the same c x 2c block: the causal work is balanced. Packed documents add a mask
(query and key in different documents) to every block, built from the row's document ids, which
every rank holds whole (the data loader reads full rows), so none travel.

The next block's transfer (one ``batch_isend_irecv`` on the CP group: send to the next rank in ring
order, receive from the previous) is posted before the current block is computed, so it overlaps
the computation. Backward visits the blocks in the same order with the saved output and lse: dQ
accumulates locally, and each block's dK/dV is added to an accumulator that travels the ring with
it and arrives back at the block's owner after cp hops.
"""
from __future__ import annotations

import torch

from kernels.attention import NpuMaskCache
from kernels.dispatch import KernelPaths
from kernels.attention_lse import attention_lse, attention_lse_backward, merge_partial


def _peers(group) -> tuple[int, int]:
    """Global ranks of the next and the previous rank in the CP ring."""
    p, r = group.size, group.rank
    return group.ranks[(r + 1) % p], group.ranks[(r - 1) % p]


def _exchange(group, send: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank, receive the previous rank's into a new buffer."""
    nxt, prv = _peers(group)
    recv = torch.empty_like(send)
    works = group.batch_isend_irecv([("send", send, nxt), ("recv", recv, prv)])
    return recv, works


def _wait(works) -> None:
    for w in works:
        w.wait()


def _blocks(step: int, rank: int, size: int, c: int):
    """(source rank, query slice, key slice, causal) of ring step ``step`` on ``rank``."""
    src = (rank - step) % size
    whole = slice(0, 2 * c)
    if step == 0:
        return src, whole, whole, True
    if src < rank:
        return src, whole, slice(0, c), False
    return src, slice(c, 2 * c), whole, False


def _mask(docs, rank, src, qs, ks):
    """(b, 1, sq, sk) True where query and key lie in different documents (None: no documents)."""
    if docs is None:
        return None
    dq, dk = docs[rank][:, qs], docs[src][:, ks]  # (b, sq), (b, sk)
    return (dq[:, :, None] != dk[:, None, :]).unsqueeze(1)


class _RingAttention(torch.autograd.Function):
    """Forward: key/value blocks around the CP ring, partial results merged by log-sum-exp;
    backward: key/value blocks around the ring again, with their travelling dK/dV accumulators."""

    @staticmethod
    def forward(ctx, q, k, v, group, docs, scale, cache, paths):
        p, r = group.size, group.rank
        q = q.contiguous()
        c = q.shape[2] // 2
        kv = torch.stack((k, v))  # (2, b, n_kv, 2c, d): one buffer travels
        b, n, sl, d = q.shape
        # laid out (b, s, n, d) in memory, as SDPA's output: the model's head merge is then a view
        out = torch.zeros(b, sl, n, d, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(p):
            recv, works = _exchange(group, kv) if step < p - 1 else (None, [])
            src, qs, ks, causal = _blocks(step, r, p, c)
            o, l = attention_lse(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal,
                                 _mask(docs, r, src, qs, ks), scale, mask_cache=cache, paths=paths)
            out[:, :, qs], lse[:, :, qs] = merge_partial(out[:, :, qs], lse[:, :, qs], o, l)
            _wait(works)
            kv = recv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if docs is None else (docs,)))
        ctx.group, ctx.scale, ctx.packed, ctx.cache = group, scale, docs is not None, cache
        ctx.paths = paths
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        docs = rest[0] if ctx.packed else None
        group, scale, cache = ctx.group, ctx.scale, ctx.cache
        p, r = group.size, group.rank
        c = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv_works, dkv_recv = [], None
        for step in range(p):
            recv, kv_works = _exchange(group, kv) if step < p - 1 else (None, [])
            src, qs, ks, causal = _blocks(step, r, p, c)
            gq, gk, gv = attention_lse_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks],
                                                kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                                                causal, _mask(docs, r, src, qs, ks), scale,
                                                mask_cache=cache, paths=ctx.paths)
            dq[:, :, qs] += gq
            if step == 0:
                acc = torch.zeros_like(kv)
            else:  # the accumulator of block ``src``, from the previous rank
                _wait(dkv_works)
                acc = dkv_recv
            acc[0][:, :, ks] += gk
            acc[1][:, :, ks] += gv
            # on to the next rank: after cp hops the accumulator is back at its block's owner
            dkv_recv, dkv_works = _exchange(group, acc) if p > 1 else (acc, [])
            _wait(kv_works)
            kv = recv
        _wait(dkv_works)
        return dq.to(q.dtype), dkv_recv[0], dkv_recv[1], None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                   document_ids: torch.Tensor | None = None, scale: float | None = None,
                   mask_cache: NpuMaskCache | None = None,
                   paths: KernelPaths | None = None) -> torch.Tensor:
    """Causal attention of this rank's load-balanced shard over the whole sequence of the CP ring.

    q (b, n, 2c, d), k and v (b, n_kv, 2c, d): the shard's heads (chunks r and 2cp-1-r along dim 2).
    ``document_ids``: (b, s) int, the document of every token of the WHOLE rows (packed documents),
    or None. ``mask_cache``: the NPU causal mask shared by the model's layers (None: one for this
    call). ``paths``: the chip's fused ops (kernels.KernelPaths; None: all), so a chip without
    npu_fusion_attention runs the portable block kernel. Returns (b, n, 2c, d). On a group of one it
    is plain causal attention of the shard.
    """
    p = group.size
    b, _, s_local, _ = q.shape
    if s_local % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {s_local}")
    docs = None
    if document_ids is not None:
        if tuple(document_ids.shape) != (b, p * s_local):
            raise ValueError(f"ring attention takes the whole rows' document ids (b, s) = "
                             f"({b}, {p * s_local}), got {tuple(document_ids.shape)}")
        c = s_local // 2
        j = torch.arange(p, device=document_ids.device)   # on the device: no host-to-device copy
        chunks = torch.stack([j, 2 * p - 1 - j], dim=1)   # (cp, 2): rank r holds chunks r, 2cp-1-r
        # (cp, b, 2c): the document ids of every rank's shard
        docs = document_ids.view(b, 2 * p, c)[:, chunks].reshape(b, p, s_local).transpose(0, 1).contiguous()
    cache = mask_cache if mask_cache is not None else NpuMaskCache()
    return _RingAttention.apply(q, k, v, group, docs, scale, cache, paths)
