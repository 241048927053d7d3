"""The multi-rank helper itself: a rank that hangs or crashes fails the test, naming it."""
from __future__ import annotations

import time

import pytest

from tests.helpers.dist_utils import run_distributed


def hang_on_rank_1(ps):
    if ps.rank == 1:
        time.sleep(600)
    return ps.rank


def test_a_hung_rank_fails_the_call_by_its_deadline():
    start = time.monotonic()
    # (rank 0 is listed too when spawning took longer than the deadline on a loaded machine)
    with pytest.raises(AssertionError, match=r"rank\(s\) \[(0, )?1\] still running after 6 s"):
        run_distributed(hang_on_rank_1, world_size=2, timeout_s=300, deadline_s=6)
    assert time.monotonic() - start < 60


def abort_on_rank_1(ps):
    if ps.rank == 1:
        import os
        os.abort()  # a native crash, as std::terminate would be
    return ps.rank


def test_a_native_crash_reports_the_ranks_thread_stacks():
    with pytest.raises(AssertionError) as info:
        run_distributed(abort_on_rank_1, world_size=2, timeout_s=20, deadline_s=120)
    message = str(info.value)
    assert "rank 1: native crash" in message and "abort_on_rank_1" in message, message
    assert "rank 0: native crash" not in message


def vanish(ps):
    import os

    import torch.distributed as dist
    dist.barrier()   # every rank's groups made: none leaves a peer inside their set-up
    os._exit(0)      # no result, no error, exit code 0


def test_a_rank_that_ends_without_a_result_fails_the_call():
    """Equivalence tests read rank 0's results: a peer that left cleanly without its result must
    not pass unseen. ``vanishes=True`` is for the jobs that end a rank that way on purpose."""
    with pytest.raises(AssertionError, match="rank 1 ---\nended without a result or an error"):
        run_distributed(vanish, world_size=2, timeout_s=10, deadline_s=60)
    assert run_distributed(vanish, world_size=2, timeout_s=10, deadline_s=60,
                           vanishes=True) == [None, None]
