"""Error-feedback residuals as logical tensors, so that a checkpoint carries them to any layout.

Each rank's residual holds its share of the gradient that the compressed exchanges have not
delivered yet (in averaged units: buckets are divided by dp before they are compressed). The
logical residual of a parameter is the sum of every rank's share:

- over the DP x CP group: a reduce-scatter leaves each rank the sum for its 1/dp shard of the
  bucket (plus, without ZeRO, the owner residual of that shard), written as flat pieces like
  ZeRO's optimizer state;
- over TP for sequence-parallel parameters, whose TP ranks each compressed a partial gradient
  (replicated parameters hold the same residual on every TP rank: tp rank 0's copy is written);
- over the first and last stage's copies of a tied embedding.

``fold_logical_residuals`` gives every rank of a new layout an equal share back (divided by dp,
and by tp for sequence-parallel parameters; a tied copy gets none), so the next exchanges deliver
exactly the gradient mass that was pending when the checkpoint was written. On the same layout
the reader restores each rank's own residuals instead (bit-identical resumption).
"""
from __future__ import annotations

import torch

from parallel.grads import all_reduce_grads_


def logical_residual_pieces(reducer, ps) -> list[tuple[str, torch.nn.Parameter, int, int, torch.Tensor]]:
    """(name, param, start, end, values): this rank's pieces of the summed residuals, flat ranges
    [start, end) of each parameter. A collective over DP (and TP, the embedding group) for every
    compressed bucket: all ranks of the layout must call it."""
    dp, rank = reducer.dp, reducer.dp_rank
    pieces = []
    for b in reducer.buckets:
        c = b.compressor
        if c is None or c.residual is None:
            continue
        n = b.numel // dp
        shard = torch.empty(n, dtype=torch.float32, device=c.residual.device)
        reducer.group.reduce_scatter_into(shard, c.residual.clone())
        if c.owner_residual is not None:
            shard += c.owner_residual[:n]
        lo = b.start + rank * n
        for slot in b.slots:
            a, e = max(lo, slot.start), min(lo + n, slot.end)
            if a < e:
                pieces.append((slot.name, slot.param, a - slot.start, e - slot.start,
                               shard[a - lo:e - lo]))
    sp = [t for _, p, _, _, t in pieces if getattr(p, "sequence_parallel", False)]
    all_reduce_grads_(sp, ps.tp_group)
    if ps.pp_size > 1:
        tied = [t for _, p, _, _, t in pieces if getattr(p, "tied_across_stages", False)]
        all_reduce_grads_(tied, ps.embedding_group)
    return pieces


def fold_logical_residuals(reducer, ps, read) -> None:
    """Under a new layout: ``read(name, param)`` returns the full logical residual of ``param``'s
    local part (its TP box), or None when the checkpoint holds none; each rank keeps an equal share."""
    for b in reducer.buckets:
        c = b.compressor
        if c is None or c.residual is None:
            continue
        c.reset()
        for slot in b.slots:
            p = slot.param
            if getattr(p, "shared_embedding", False):
                continue                                   # the first stage's copy carries it
            values = read(slot.name, p)
            if values is None:
                continue
            share = reducer.dp * (ps.tp_size if getattr(p, "sequence_parallel", False) else 1)
            c.residual[slot.start - b.start:slot.end - b.start] = values.reshape(-1).float() / share
