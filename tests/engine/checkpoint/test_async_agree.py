"""The async saver's completion all-reduce (``agree``) goes through the world group's CommGroup:
counted, numbered in the rank's Activity, and held to the backend rules' lane check."""
from __future__ import annotations

import pytest

from engine.checkpoint.async_writer import agree
from parallel.grid.topology import RankGrid
from parallel.runtime.backend_rules import BackendRuleError
from parallel.runtime.lanes import EXCHANGE_LANE, lane
from tests.helpers.dist_utils import run_distributed


def _agree(ps):
    calls, entered = ps.comm.counters["world"].calls, ps.comm.activity.entered["world"]
    sums = agree(ps, [ps.rank, 1, 0, 2])
    out = {"sums": sums, "calls": ps.comm.counters["world"].calls - calls,
           "entered": ps.comm.activity.entered["world"] - entered}
    with lane(EXCHANGE_LANE), pytest.raises(BackendRuleError, match="lane"):
        agree(ps, [0, 0, 0, 0])        # refused before it is issued: no rank enters it
    out["after"] = agree(ps, [1, 1, 1, 1])
    return out


def test_agree_is_a_collective_of_the_world_group():
    for out in run_distributed(_agree, grid=RankGrid(dp=2)):
        assert out["sums"] == [1, 2, 0, 4] and out["after"] == [2, 2, 2, 2]
        assert out["calls"] == 1 and out["entered"] == 1
