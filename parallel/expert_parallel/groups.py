"""Create the expert-parallel and expert-data-parallel groups of a ParallelState.

``new_group`` is collective: every rank of the world creates every group, in the order of
``ExpertGrid.groups`` (EP first, then EDP), after ``ParallelState.initialize``; the ETP group is
the TP group itself (no new group). With ``exchange`` (gradient compression) the EDP groups are
made a second time, last, on the exchange worker's lane (parallel/runtime/lanes.py), so that the
worker orders the compressed expert buckets on communicators of its own, as it does the DP x CP
ones. The bad input (``ep`` not dividing dp x cp, etp other than 1 and tp) is refused by the pure
``ExpertGrid`` before the first group.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from parallel.runtime.comm import CommGroup, single_rank_group
from parallel.grid.expert_groups import ExpertGrid
from parallel.runtime.lanes import EXCHANGE_LANE
from parallel.grid.state import ParallelState


def init_expert_groups(ps: ParallelState, ep: int, timeout_s: float = 300.0,
                       etp: int = 1, exchange: bool = False) -> ExpertGrid:
    """Set ``ps.ep_group`` and ``ps.edp_group`` for expert parallelism of size ``ep``; with
    ep = 1 the EP group is this rank alone and the EDP group is ``ps.dp_cp_group``. ``etp`` (1 or
    tp) sets ``ps.etp_group``: the TP group itself, or this rank alone. ``exchange`` also sets
    ``ps.edp_exchange_group`` (with ep = 1: ``ps.dp_exchange_group``)."""
    egrid = ExpertGrid(ps.grid, ep, etp)
    if etp > 1:  # ETP = TP: no new process group
        ps.etp_group = ps.tp_group
    if ep == 1:
        ps.ep_group = single_rank_group("ep", ps.rank, ps.comm)
        ps.edp_group, ps.edp_exchange_group = ps.dp_cp_group, ps.dp_exchange_group
        return egrid
    timeout = datetime.timedelta(seconds=timeout_s)

    def create(dim: str, lane: str | None = None) -> CommGroup:
        mine = None
        for ranks in egrid.groups(dim):
            if len(ranks) == 1:
                if ps.rank in ranks:
                    mine = single_rank_group(dim, ps.rank, ps.comm)
                continue
            pg = dist.new_group(ranks, timeout=timeout, backend=ps.backend)
            if ps.rank in ranks:
                mine = CommGroup(dim, tuple(ranks), ranks.index(ps.rank), pg, ps.comm)
        if lane is not None:
            mine.lane = lane
        return mine

    ps.ep_group, ps.edp_group = create("ep"), create("edp")
    ps.edp_exchange_group = create("edp", EXCHANGE_LANE) if exchange else None
    return egrid
