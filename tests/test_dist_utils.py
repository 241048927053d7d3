"""The multi-rank helper itself: a rank that hangs fails the test instead of blocking it."""
from __future__ import annotations

import time

import pytest

from tests.dist_utils import run_distributed


def hang_on_rank_1(ps):
    if ps.rank == 1:
        time.sleep(600)
    return ps.rank


def test_a_hung_rank_fails_the_call_by_its_deadline():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] still running after 30 s"):
        run_distributed(hang_on_rank_1, world_size=2, timeout_s=300, deadline_s=30)
    assert time.monotonic() - start < 90
