"""The heartbeat's watchdog describes a collective stuck in any group of the rank, the expert groups
(ep, edp) included, and says so when it does not know a group's members instead of guessing."""
from __future__ import annotations

import io
import time

import torch.distributed as dist

from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from parallel.runtime.comm import CommGroup
from parallel.runtime.heartbeat import Heartbeat, describe_peers


class _Store:
    """The default store's stand-in: its clone is an in-memory store."""

    def clone(self):
        return dist.HashStore()


def _moe_state() -> ParallelState:
    """Rank 0 of dp = 4 with expert parallelism 2: ep (0, 1), edp (0, 2)."""
    ps = ParallelState(RankGrid(dp=4), rank=0)
    ps.dp_group = CommGroup("dp", (0, 1, 2, 3), 0, monitor=ps.comm)
    ps.dp_cp_group = CommGroup("dp_cp", (0, 1, 2, 3), 0, monitor=ps.comm)
    ps.ep_group = CommGroup("ep", (0, 1), 0, monitor=ps.comm)
    ps.edp_group = CommGroup("edp", (0, 2), 0, monitor=ps.comm)
    return ps


def test_the_watchdog_names_the_members_of_an_expert_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: _Store())
    ps = _moe_state()
    hb = Heartbeat.for_state(ps, 5.0, "gloo")
    try:
        assert hb.groups["ep"] == (0, 1) and hb.groups["edp"] == (0, 2)
        assert hb.groups["dp"] == (0, 1, 2, 3) and hb.groups["world"] == (0, 1, 2, 3)
        hb.stream = io.StringIO()
        for _ in range(3):
            ps.comm.activity.enter("all_to_all", "ep")
        ps.comm.activity.blocked = ("all_to_all", "ep", 3, time.time() - 60.0)
        hb.beat()
        hb._watch()
    finally:
        ps.comm.activity.blocked = None
        hb.stop()
    text = hb.stream.getvalue()
    assert "all_to_all #3 of the ep group (ranks [0, 1])" in text, text
    assert "entered by rank 0; not entered by rank 1 (no heartbeat" in text
    assert "every member entered it" not in text


def test_a_single_rank_expert_group_is_left_out():
    ps = ParallelState(RankGrid(dp=2), rank=0)       # no expert parallelism: ep is this rank alone
    groups = Heartbeat.group_ranks(ps)
    assert "ep" not in groups and groups["world"] == (0, 1)


def test_unknown_members_are_not_reported_as_all_entered():
    for tag in (("all_to_all", "ep", 3), ("p2p", "pp", 2)):
        text = describe_peers(tag, (), {}, 0.0, 4.0)
        assert "members unknown" in text and "every member entered it" not in text, text
        assert "entered by no rank" not in text
