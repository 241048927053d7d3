"""A backend that returns one work for a whole point-to-point batch (NCCL's coalesced batches):
waiting for it covers every transfer of the batch for the stream-order checker, the first as much
as the last, so a buffer of any of them released after that wait is checked against the comm
stream."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.grid.topology import RankGrid
from parallel.runtime import streams
from parallel.runtime.stream_check import StreamChecker
from tests.helpers.dist_utils import run_distributed


class _Coalesced:
    """One handle for the works of a batch, as a coalescing backend returns."""

    def __init__(self, works):
        self.works = works

    def wait(self, *args, **kwargs):
        return all(w.wait(*args, **kwargs) is not False for w in self.works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _coalesced_batch(ps):
    group, peer = ps.dp_group, ps.dp_group.ranks[1 - ps.dp_group.rank]
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_Coalesced(real(ops))]
    out = {}
    try:
        checker = StreamChecker()
        with checker.installed():
            side = streams.side_stream("side", "cpu")
            for ordered in (False, True):
                checker.violations.clear()
                s, r = torch.arange(4.0), torch.empty(4)       # made by the compute stream
                transfers = [("send", s, peer), ("recv", r, peer)] if ps.rank == 0 else \
                    [("recv", r, peer), ("send", s, peer)]
                streams.wait_stream(side, streams.current_stream("cpu"))
                with streams.use(side):
                    works = group.batch_isend_irecv(transfers)
                    for w in works:
                        w.wait()
                if ordered:
                    streams.wait_stream(streams.current_stream("cpu"), side)
                streams.released(s)                             # back to compute's pool
                streams.released(r)
                out[ordered] = (len(works), list(checker.violations))
    finally:
        dist.batch_isend_irecv = real
    return out


def test_a_coalesced_batch_wait_covers_every_transfer():
    for out in run_distributed(_coalesced_batch, grid=RankGrid(dp=2)):
        n, found = out[False]
        assert n == 1 and len(found) == 2, found                # both buffers, not just the last's
        assert all(m.startswith("released while in use") for m in found), found
        assert any("send on dp" in m for m in found) and any("recv on dp" in m for m in found)
        assert out[True] == (1, [])
