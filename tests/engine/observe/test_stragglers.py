"""Stragglers: a rank is compared with its peers doing the same work (its pipeline stages), never
with the other stages, and reported only past --straggler-threshold.

The pure rule runs on hand-made rows; the whole path runs on 4 real gloo ranks, (tp=1, pp=2, dp=2),
with ranks slowed by fault injection (engine/observe/faults.py SlowRank): a whole stage made slower
than the other is no straggler (the false alarm of comparing every rank with the median of all),
and one rank made slower than its stage peer is named, on every rank, in one printed line."""
import contextlib
import io

import pytest

from engine.config.cli import parse_args
from engine.observe.faults import SlowRank
from engine.observe.stragglers import StragglerReport, describe_role, peer_ratios, peer_roles
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr-warmup-iters", "1", "--timeout-s", "60"]
KEYS = ("straggler_rank", "straggler_ratio", "straggler_waited_for")


def _row(compute, pp=0.0, dp=0.0):
    return [compute, 0.0, 0.0, pp, dp, 0.0]


# ---- the rule, on hand-made rows ----------------------------------------------------------------
def test_roles_are_the_stages_a_rank_holds():
    grid = RankGrid(tp=1, pp=2, dp=2)  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    assert peer_roles(grid) == [(("stages", (0,)),)] * 2 + [(("stages", (1,)),)] * 2
    # zb-v: pipeline rank 0 holds the first and the last of 4 virtual stages
    assert [dict(r)["stages"] for r in peer_roles(grid, 2, "v")] == [(0, 3), (0, 3), (1, 2), (1, 2)]
    assert [dict(r)["stages"] for r in peer_roles(grid, 2, "loop")] == [(0, 2), (0, 2), (1, 3), (1, 3)]
    # the hook for work that differs inside a stage (MoE experts): it splits the peers
    roles = peer_roles(grid, extra=lambda rank: (("experts", rank % 2),))
    assert len(set(roles)) == 4
    assert describe_role(roles[3]) == "pipeline stage 1, experts 1"
    assert describe_role(peer_roles(grid, 2, "v")[0]) == "pipeline stages 0, 3"


def test_a_slow_stage_is_no_straggler_but_a_slow_peer_is():
    roles = peer_roles(RankGrid(tp=2, pp=2, dp=2))  # ranks 0-3 stage 0, ranks 4-7 stage 1
    # make train's picture: the last stage (output layer and loss) computes ~3x the first
    rows = [_row(0.10, pp=0.30)] * 4 + [_row(0.31, dp=0.01), _row(0.30), _row(0.32), _row(0.30)]
    report = StragglerReport.from_rows((11, 20), rows, roles)
    assert not report.found and report.straggler_rank is None
    assert report.straggler_ratio == pytest.approx(0.32 / 0.30)  # the figure, below 1.2
    assert report.metrics() == {"straggler_rank": None, "straggler_ratio": report.straggler_ratio,
                                "straggler_waited_for": 5}  # blocked least
    # the old rule (every rank against the median of all) names a last-stage rank 3.2x
    everyone = StragglerReport.from_rows((11, 20), rows)
    assert everyone.straggler_rank == 6 and everyone.straggler_ratio == pytest.approx(3.2)
    # one first-stage rank 1.5x its three peers: named, with its ratio over their lower median
    rows[2] = _row(0.15)
    report = StragglerReport.from_rows((11, 20), rows, roles)
    assert report.stragglers == [2] and report.straggler_rank == 2
    assert report.straggler_ratio == pytest.approx(1.5) and report.ratios[0] == pytest.approx(1.0)
    assert report.describe(RankGrid(tp=2, pp=2, dp=2)) == (
        "stragglers, steps 11-20 (past --straggler-threshold 1.2x): rank 2 (tp 0, pp 0, dp 1) "
        "computed 0.150 s, 1.50x the 0.100 s of its peers (ranks 0, 1, 3: pipeline stage 0); the "
        "others waited for rank 2 (tp 0, pp 0, dp 1) (it waited 0.000 s, the median rank 0.000 s)")


def test_threshold_and_ranks_without_peers():
    roles = peer_roles(RankGrid(dp=2))
    rows = [_row(0.115), _row(0.100, dp=0.015)]
    assert not StragglerReport.from_rows((1, 2), rows, roles).found  # 1.15x < 1.2x
    low = StragglerReport.from_rows((1, 2), rows, roles, threshold=1.1)
    assert low.stragglers == [0] and low.waited_for == 0
    # pp=2, dp=1: each stage alone, nobody to compare with: no ratio, no straggler
    alone = StragglerReport.from_rows((1, 2), [_row(0.5), _row(0.1, pp=0.4)], peer_roles(RankGrid(pp=2)))
    assert alone.ratios == [None, None] and alone.straggler_ratio is None and not alone.found
    assert alone.waited_for == 0
    assert peer_ratios([0.2, 0.0, 0.0], [1, 1, 1]) == [None, None, None]  # peers that did nothing
    assert peer_ratios([0.2, 0.1, 0.1], ["a", "a", "b"]) == [2.0, 0.5, None]
    with pytest.raises(ValueError, match="threshold must be above 1.0"):
        StragglerReport.from_rows((1, 2), rows, roles, threshold=1.0)
    with pytest.raises(ValueError, match="2 ranks reported but 3 roles"):
        StragglerReport.from_rows((1, 2), rows, roles + roles[:1])


# ---- the whole path on 4 gloo ranks -------------------------------------------------------------
def _run(faults):
    from engine.training.trainer import Trainer
    trainer = Trainer(parse_args(TINY + ["--pp", "2", "--train-iters", "3", "--log-interval", "3"]))
    for fault in faults:
        fault.install(trainer)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            records = trainer.train().records
        report = trainer.stragglers.last_report
        return {"records": [{k: r[k] for k in KEYS} for r in records], "printed": err.getvalue(),
                "rows": [[c, *b] for c, b in zip(report.compute_s, report.blocked_s)],
                "stragglers": report.stragglers}
    finally:
        trainer.close()


def slowed_runs(ps):
    # every rank sleeps 60 ms before each forward (its compute then outweighs this machine's
    # noise), stage 1 (ranks 2, 3) 120 ms more: a slower stage, not a straggler
    base = [SlowRank(rank=r, seconds=0.06) for r in range(4)] + [SlowRank(rank=r, seconds=0.12)
                                                                 for r in (2, 3)]
    return {"stage": _run(base), "rank": _run(base + [SlowRank(rank=1, seconds=0.3)])}


def test_pipeline_stages_compare_with_their_peers_only():
    res = run_distributed(slowed_runs, grid=RankGrid(dp=4), timeout_s=120)
    for rank in range(4):
        stage, slow = res[rank]["stage"], res[rank]["rank"]
        # a stage 4x slower than the other: nothing found, nothing printed, keys kept
        first, second, last = stage["records"]
        # only at the interval's last step; its sums leave out step 1, the warm-up
        assert first == second == dict.fromkeys(KEYS)
        assert last["straggler_rank"] is None and stage["stragglers"] == []
        assert last["straggler_ratio"] is not None and last["straggler_ratio"] <= 1.2, last
        assert "straggler" not in stage["printed"] and (rank > 0 or "step 3/3: loss" in stage["printed"])
        # ... which comparing every rank with the median of all would have named
        assert StragglerReport.from_rows((2, 3), stage["rows"]).straggler_rank in (2, 3)
        # rank 1 slowed against its stage peer, rank 0: named on every rank; rank 3, which waits
        # for rank 1 in its pipeline receives, is not (waiting is not computing)
        last = slow["records"][-1]
        assert slow["stragglers"] == [1], slow
        assert last["straggler_rank"] == 1 and last["straggler_ratio"] > 3, last
        assert last["straggler_waited_for"] == 1
    printed = res[0]["rank"]["printed"]
    assert printed.count("gridtron: stragglers") == 1, printed
    assert "steps 2-3 (past --straggler-threshold 1.2x): rank 1 (tp 0, pp 0, dp 1) computed" in printed
    assert "of its peers (rank 0: pipeline stage 0); the others waited for rank 1" in printed
    assert all(res[r]["rank"]["printed"] == "" for r in (1, 2, 3))  # rank 0 prints
