"""The TP ring: an all-gather and a reduce-scatter along the sequence, one chunk per step, each
step's transfer in flight while that step's GEMMs run (``--tp-comm-overlap``, overlap.py).

Rank r of a TP group of n sends to rank r+1 and receives from rank r-1 (mod n). Both rings take n
steps; at step k

- the all-gather ring holds chunk (r - k) mod n (its own at k = 0) and, unless it is the last
  step, posts "send it right, receive chunk (r - k - 1) from the left" *before* handing the chunk
  to ``on_chunk`` (the GEMMs that read it); the receive is waited for at the start of step k + 1;
- the reduce-scatter ring computes this rank's partial sum for chunk (r - k - 1) mod n
  (``partial(c)``, a GEMM), adds the accumulator received from the left (waited for only after the
  GEMM) and, unless it is the last step, posts "send the sum right, receive the next from the
  left": the sum travels while the next step's GEMM runs. After n steps the accumulator holds
  chunk r summed over every rank.

Every transfer is one ``CommGroup.batch_isend_irecv`` (a send and its matching receive in one batch,
as NCCL and HCCL need to run a ring without deadlock), so the backend rules, the byte counters, the
rank's Activity and the stream-order checker see each chunk. The two rings of one backward run in
the same loop, posting in the same order on every rank (all-gather first), so transfers between
two neighbours match one to one. Sends are waited for at the end (a send's tensor is not written
again, so nothing has to wait for it earlier).
"""
from __future__ import annotations

from typing import Callable

import torch

SEQ = 1  # activations are (b, s, h): the sequence is dim 1


def chunk_of(t: torch.Tensor, c: int, n: int) -> torch.Tensor:
    """Sequence chunk ``c`` of ``n`` of a (b, s, ...) tensor: (b, s/n, ...), a view."""
    size = t.shape[SEQ] // n
    return t.narrow(SEQ, c * size, size)


def ring_pass(group, shard: torch.Tensor | None = None,
              on_chunk: Callable[[int, torch.Tensor], None] | None = None,
              partial: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor | None:
    """Run the all-gather ring of ``shard`` (this rank's (b, s/n, ...) chunk; ``on_chunk(c, x_c)``
    sees every rank's chunk c, its own first) and/or the reduce-scatter ring of ``partial(c)``
    (this rank's (b, s/n, ...) partial sum of chunk c); returns this rank's reduced chunk, or None
    without ``partial``."""
    n, r = group.size, group.rank
    right, left = group.ranks[(r + 1) % n], group.ranks[(r - 1) % n]
    sends: list = []
    cur = None if shard is None else shard.contiguous()  # what travels must be dense
    incoming, acc, acc_in = None, None, None
    for k in range(n):
        last = k == n - 1
        if shard is not None:
            if incoming is not None:       # chunk (r - k) arrived from the left
                incoming[1].wait()
                cur = incoming[0]
            incoming = None
            if not last:                   # the next chunk travels while this one is multiplied
                nxt = torch.empty_like(cur)
                works = group.batch_isend_irecv([("send", cur, right), ("recv", nxt, left)])
                sends.append(works[0])
                incoming = (nxt, works[-1])
            on_chunk((r - k) % n, cur)
        if partial is not None:
            part = partial((r - k - 1) % n)  # (b, s/n, ...) this rank's share of the chunk
            if acc_in is not None:           # the sum so far, from the left
                acc_in[1].wait()
                part = part + acc_in[0]
            acc, acc_in = part.contiguous(), None
            if not last:                     # the sum travels while the next GEMM runs
                buf = torch.empty_like(acc)
                works = group.batch_isend_irecv([("send", acc, right), ("recv", buf, left)])
                sends.append(works[0])
                acc_in = (buf, works[-1])
    for work in sends:
        work.wait()
    return acc
