"""Error-feedback residuals as logical tensors, so that a checkpoint carries them to any layout.

Each rank's residual holds its share of the gradient that the compressed exchanges have not
delivered yet (in averaged units: buckets are divided by dp before they are compressed). The
logical residual of a parameter is the sum of every rank's share:

- over the DP x CP group (an expert bucket: over its expert-data-parallel group, the ranks that
  hold the same experts): a reduce-scatter leaves each rank the sum for its 1/dp shard of the
  bucket (plus, without ZeRO, the owner residual of that shard), written as flat pieces like
  ZeRO's optimizer state;
- over TP for sequence-parallel parameters, whose TP ranks each compressed a partial gradient
  (replicated parameters hold the same residual on every TP rank: tp rank 0's copy is written);
- over the first and last stage's copies of a tied embedding.

``fold_logical_residuals`` gives every rank of a new layout an equal share back (divided by dp,
or the EDP size for an expert, and by tp for sequence-parallel parameters; a tied copy gets
none), so the next exchanges deliver
exactly the gradient mass that was pending when the checkpoint was written. On the same layout
the reader restores each rank's own residuals instead (bit-identical resumption).

The compressors that keep a momentum between exchanges (``exchanges_momentum``: onebit's M, equal
on every rank, and top-k's per-rank velocity u_r, dgc.py) carry it the same way with
``kind="momentum"``: the logical momentum is the DP *mean* of the ranks' tensors (the momentum of
the mean gradient, since the momentum is linear in the gradient), summed over TP for
sequence-parallel parameters and over a tied embedding's copies; every rank of the new layout
takes the mean itself (divided by tp for sequence-parallel parameters). A momentum not yet
gathered under ZeRO (seeded from exp_avg at the end of the warm-up) is not written: the reader
seeds it from exp_avg again.
"""
from __future__ import annotations

import torch

from parallel.grads.main_grad import all_reduce_grads_


def _held(c, kind: str):
    """The compressor's per-rank tensor of ``kind`` ("residual" or "momentum"), or None."""
    if c is None:
        return None
    if kind == "momentum":
        return c.momentum if getattr(c, "exchanges_momentum", False) else None
    return c.residual


def logical_residual_pieces(reducer, ps, kind: str = "residual",
                            ) -> list[tuple[str, torch.nn.Parameter, int, int, torch.Tensor]]:
    """(name, param, start, end, values): this rank's pieces of the logical residuals (or, with
    ``kind="momentum"``, momenta), flat ranges [start, end) of each parameter. A collective over DP
    (and TP, the embedding group) for every such bucket: all ranks of the layout must call it."""
    pieces = []
    for b in reducer.buckets:
        c = b.compressor
        held = _held(c, kind)
        if held is None or held.numel() != b.numel:
            continue
        group = b.group or reducer.group                  # an expert bucket's: its EDP group
        dp, rank = group.size, group.rank
        n = b.numel // dp
        shard = torch.empty(n, dtype=torch.float32, device=held.device)
        group.reduce_scatter_into(shard, held.clone())
        if kind == "momentum":
            shard /= dp
        elif c.owner_residual is not None:
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


def fold_logical_residuals(reducer, ps, read, kind: str = "residual") -> None:
    """Under a new layout: ``read(name, param)`` returns the full logical residual (momentum) of
    ``param``'s local part (its TP box), or None when the checkpoint holds none; each rank keeps an
    equal share of a residual, the whole mean of a momentum."""
    for b in reducer.buckets:
        c = b.compressor
        if kind == "momentum":
            if c is None or not getattr(c, "exchanges_momentum", False):
                continue
            full = torch.zeros(b.numel, dtype=torch.float32, device=ps.device)
            if _fold(reducer, ps, b, full, read, 1):      # else: seeded from exp_avg, as saved
                c.set_momentum(full)
            continue
        if c is None or c.residual is None:
            continue
        c.clear()
        _fold(reducer, ps, b, c.residual, read, (b.group or reducer.group).size)


def _fold(reducer, ps, b, dst: torch.Tensor, read, dp_share: int) -> bool:
    """``dst`` (the bucket's layout) gets each slot's logical values / its share; whether any
    were found."""
    found = False
    for slot in b.slots:
        p = slot.param
        if getattr(p, "shared_embedding", False):
            continue                                   # the first stage's copy carries it
        values = read(slot.name, p)
        if values is None:
            continue
        share = dp_share * (ps.tp_size if getattr(p, "sequence_parallel", False) else 1)
        dst[slot.start - b.start:slot.end - b.start] = values.reshape(-1).float() / share
        found = True
    return found
