"""Context-parallel attention: the one entry point the model's attention layer calls when cp > 1.

``p2p`` runs ring attention (ring.py) on the load-balanced shard; ``a2a`` runs Ulysses: an
all-to-all from sequence-sharded to head-sharded q, k, v, the ordinary attention kernel over the whole
sequence for 1/cp of the heads (packed documents, GQA and the NPU/CUDA varlen paths included), and
the all-to-all back.
"""
from __future__ import annotations

import math

import torch

import kernels
from parallel.context_parallel.all_to_all import head_to_seq, seq_to_head
from parallel.context_parallel.ring import ring_attention
from parallel.context_parallel.sharding import COMM_TYPES


def ulysses_kv_repeat(kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so the heads split evenly over cp ranks:
    1 when cp divides them, else cp / gcd(kv_heads, cp) (each rank then gets whole heads that serve
    exactly its query heads). Example: 2 KV heads, 8 query heads, cp 4 -> repeat 2."""
    return cp // math.gcd(kv_heads, cp)


def ulysses_attention(q, k, v, group, dropout_p: float = 0.0, scale: float | None = None,
                      document_ids=None, cu_seqlens=None, mask_cache=None,
                      paths=None) -> torch.Tensor:
    """q (b, n, s/cp, d), k, v (b, n_kv, s/cp, d) contiguous sequence shards -> (b, n, s/cp, d).
    ``document_ids`` / ``cu_seqlens``: those of the WHOLE rows (packed documents), or None."""
    rep = ulysses_kv_repeat(k.shape[1], group.size)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qh, kh, vh = seq_to_head(q, group), seq_to_head(k, group), seq_to_head(v, group)
    out = kernels.attention(qh, kh, vh, causal=True, dropout_p=dropout_p, scale=scale,
                            document_ids=document_ids, cu_seqlens=cu_seqlens,
                            mask_cache=mask_cache, paths=paths)  # (b, n/cp, s, d)
    return head_to_seq(out, group)


def context_parallel_attention(q, k, v, group, comm_type: str = "p2p", *, dropout_p: float = 0.0,
                               scale: float | None = None, document_ids=None,
                               cu_seqlens=None, mask_cache=None, paths=None) -> torch.Tensor:
    """Causal attention of this CP rank's sequence shard over the whole sequence.

    q (b, n, s/cp, d), k and v (b, n_kv, s/cp, d), the shard sharding.py assigns for ``comm_type``;
    ``document_ids`` (b, s) and ``cu_seqlens`` describe the WHOLE rows' documents (None: one document
    per row). ``mask_cache`` and ``paths``: the layer's NPU causal mask and fused-kernel choices
    (kernels.attention's). Returns (b, n, s/cp, d).
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {COMM_TYPES}, got {comm_type!r}")
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, group, dropout_p, scale, document_ids, cu_seqlens,
                                 mask_cache, paths)
    if dropout_p > 0.0:
        raise ValueError("ring attention (--cp-comm-type p2p) applies no attention dropout: use "
                         "--attention-dropout 0 or --cp-comm-type a2a")
    return ring_attention(q, k, v, group, document_ids, scale, mask_cache, paths)
