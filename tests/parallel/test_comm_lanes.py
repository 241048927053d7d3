"""One communicator, one thread (parallel/runtime/lanes.py).

- Pure: ``check_lane`` refuses a group to a thread outside its lane, with a message naming the
  group, the thread that first issued on it and the offending thread; without rules it is silent.
- On gloo (2 ranks, HCCL rules): a job of the exchange worker (run in the exchange lane, from the
  step's thread) is refused the main DP group, before anything is sent, and is served on
  ``ps.dp_exchange_group``, its own communicator over the same ranks; a thread outside the
  worker's lane is refused that one.
- A compressed reducer needs the exchange group and says how to get it.
"""
from __future__ import annotations

import re
import threading

import pytest
import torch

from parallel.runtime.backend_rules import BackendRuleError, get_rules
from parallel.runtime.comm import CommGroup
from parallel.runtime.comm_monitor import CommMonitor
from parallel.dp.exchange import ExchangeWorker
from parallel.dp.reducer import GradReducer
from parallel.runtime.lanes import (EXCHANGE_LANE, MAIN_LANE, check_lane, current_lane, lane,
                                    order_mismatch)
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

HCCL = get_rules("hccl")


def test_a_group_is_refused_outside_its_lane():
    main = CommGroup("dp", (0, 1), 0)
    own = CommGroup("dp", (0, 1), 0, lane=EXCHANGE_LANE)
    assert current_lane() == MAIN_LANE and repr(own) == "CommGroup(dp, ranks=[0, 1], lane=dp-exchange)"
    check_lane(HCCL, main, "all_reduce")                         # the main thread comes first
    assert main.first_thread == threading.current_thread().name
    with lane(EXCHANGE_LANE):
        with pytest.raises(BackendRuleError) as exc:
            check_lane(HCCL, main, "all_reduce")
        check_lane(HCCL, own, "all_to_all")
        check_lane(None, main, "all_reduce")                     # no rules: no check
    message = str(exc.value)
    assert "CommGroup(dp, ranks=[0, 1])" in message and "lane 'dp-exchange'" in message
    assert f"first used by thread {main.first_thread!r}" in message
    assert "ps.dp_exchange_group" in message and "deadlocks" in message
    assert current_lane() == MAIN_LANE                           # the block's lane is undone
    with pytest.raises(BackendRuleError, match="belongs to lane 'dp-exchange'"):
        check_lane(HCCL, own, "all_gather")                      # and the other way round


def _threads(ps):
    """The exchange worker's job issues on the main DP group (refused on every rank before
    anything is sent), then on its own group (delivered); a plain thread is refused the worker's
    group."""
    main, own = ps.dp_group, ps.dp_exchange_group
    assert (own.kind, own.ranks, own.lane) == (main.kind, main.ranks, EXCHANGE_LANE)
    assert own.pg is not None and own.pg is not main.pg          # a communicator of its own
    main.all_reduce(torch.ones(1))                               # the main thread was first
    worker = ExchangeWorker(torch.device("cpu"))
    x = torch.ones(2)
    try:
        worker.submit(main.all_reduce, x)
        refused = None
    except BackendRuleError as exc:
        refused = str(exc)
    worker.submit(own.all_reduce, x)
    worker.drain()
    worker.close()
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, own.all_reduce, torch.ones(1)),
                              name="stray")
    thread.start()
    thread.join()
    main.all_reduce(torch.ones(1))                               # both groups are still usable
    return {"refused": refused, "x": x.tolist(), "stray": errors}


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BackendRuleError as exc:
        errors.append(str(exc))


def test_exchange_jobs_get_their_own_communicator_on_gloo():
    for r in run_distributed(_threads, grid=RankGrid(dp=2), backend_rules="hccl"):
        assert r["refused"] and re.search(r"thread 'MainThread' \(lane 'dp-exchange'\)",
                                          r["refused"]), r["refused"]
        assert "CommGroup(dp, ranks=[0, 1])" in r["refused"] and "'MainThread'" in r["refused"]
        assert r["x"] == [2.0, 2.0]                              # summed once, on its own group
        assert len(r["stray"]) == 1 and "thread 'stray' (lane 'main')" in r["stray"][0]


def test_compression_needs_the_exchange_group():
    monitor = CommMonitor("hccl")
    dp = CommGroup("dp", (0, 1), 0, monitor=monitor)
    ps = ParallelState(RankGrid(dp=2), comm=monitor, dp_group=dp, dp_cp_group=dp)
    assert ps.dp_exchange_group is None                          # not asked for at start-up
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"dp_exchange=True"):
        GradReducer(model, ps, compression_policy={"default": "int8", "warmup_steps": 0})
    GradReducer(model, ps).remove_hooks()                        # uncompressed: not needed
    serial = ParallelState.serial()
    assert serial.dp_exchange_group.size == 1 and serial.dp_exchange_group.lane == EXCHANGE_LANE


def test_order_mismatch_names_the_first_difference():
    tp, dp = ("tp", MAIN_LANE, (0, 1)), ("dp", EXCHANGE_LANE, (0, 1))
    other = ("tp", MAIN_LANE, (2, 3))
    same = [(tp, "all_reduce"), (dp, "all_to_all"), (tp, "all_gather")]
    assert order_mismatch({0: same, 1: list(same), 2: [(other, "all_reduce")]}) is None
    swapped = [(dp, "all_to_all"), (tp, "all_reduce"), (tp, "all_gather")]
    assert order_mismatch({0: same, 1: swapped}) == (
        "ranks 0 and 1 submit to their shared communicators in different orders: submission 1 "
        "is all_reduce on tp [0, 1] on rank 0 but all_to_all on dp/dp-exchange [0, 1] on rank 1")
    # a rank outside a communicator is not held to its order; a missing submission is named
    assert order_mismatch({0: same, 2: [(other, "all_reduce")]}) is None
    assert "submission 3 is all_gather on tp [0, 1] on rank 0 but nothing on rank 1" in \
        order_mismatch({0: same, 1: same[:2]})


def test_order_mismatch_sees_a_communicator_only_one_member_used():
    """A collective on a communicator rank 1 belongs to but never submitted to is a mismatch (NCCL
    would hold everything after it on that communicator), not a communicator to leave out."""
    dp = ("dp", MAIN_LANE, (0, 1))
    assert order_mismatch({0: [(dp, "all_reduce")], 1: []}) == (
        "ranks 0 and 1 submit to their shared communicators in different orders: submission 1 "
        "is all_reduce on dp [0, 1] on rank 0 but nothing on rank 1")
    assert "submission 1 is nothing on rank 0 but all_reduce on dp [0, 1] on rank 1" in \
        order_mismatch({0: [], 1: [(dp, "all_reduce")]})
    assert order_mismatch({0: [(dp, "all_reduce")], 2: []}) is None    # 2 is no member
