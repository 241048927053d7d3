"""Stragglers: a rank is compared with its peers doing the same work (its pipeline stages), never
with the other stages, and reported only past --straggler-threshold.

The pure rule runs on hand-made rows; the whole path runs on 4 real gloo ranks, (tp=1, pp=2, dp=2),
with ranks slowed by fault injection (engine/observe/faults.py SlowRank): a whole stage made slower
than the other is no straggler (the false alarm of comparing every rank with the median of all),
and one rank made slower than its stage peer is named, on every rank, in one printed line. The
monitor's own timing (each report one interval late, with no wait) runs on a scripted clock."""
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
    return [compute, 0.0, 0.0, pp, dp, 0.0, 0.0]  # compute, blocked in tp, cp, pp, dp, ep, other


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


# ---- the monitor's timing: no wait of its own, the same sums one interval late ------------------
class _ScriptedClock:
    """Device time by hand: ``wait()`` is a step's one wait (stamps up to it are complete);
    ``elapsed_s`` of a later stamp counts a wait, as engine/device/clock.py's DeviceClock does."""

    def __init__(self):
        self.now, self.settled, self.waits = 0.0, float("-inf"), 0

    def stamp(self):
        self.now += 1e-6  # (distinct stamps)
        return self.now

    def elapsed_s(self, start, end):
        self.waits += end > self.settled
        return end - start

    def wait(self):
        self.settled = self.stamp()


class _TwoRanks:
    """A ParallelState of two ranks of one stage on one process: rank 1's row is fixed; every
    all-gather is recorded with the step it was issued at, and leaves a span."""

    def __init__(self, peer_row):
        import torch
        from parallel.runtime.comm_monitor import Activity
        self.grid, self.world_size, self.device = RankGrid(dp=2), 2, torch.device("cpu")
        self.peer_row, self.gathers = peer_row, []
        self.comm = type("Comm", (), {"activity": Activity()})()
        self.world_group = self

    def all_gather_into(self, out, mine):
        import torch
        self.gathers.append(self.comm.activity.step)
        out.copy_(torch.cat([mine, torch.tensor(self.peer_row, dtype=torch.float32)]))
        self.comm.activity.spans.append(("world", 0.0, 0.0))


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_report_reads_complete_steps_one_interval_late(interval):
    """Step k computes k seconds, 0.5 s of which blocked in a dp collective, then its update runs
    past the step's wait (0.25 s, complete only at the next step's wait). Every report has exactly
    its interval's sums (step 1, the warm-up, left out) and comes at step N + L (N + 2 with L = 1)
    for the interval ending at N; the monitor never reads a stamp the device has not reached
    (the old report waited for its interval's last step, then read the gather at once)."""
    from engine.observe.stragglers import StragglerMonitor
    clock, ps = _ScriptedClock(), _TwoRanks(_row(1.0, dp=0.5))
    monitor = StragglerMonitor(ps, clock)
    reports = {}
    for step in range(1, 10):
        monitor.begin_step(step)
        clock.now += step - 0.5
        a = clock.stamp()
        clock.now += 0.5
        ps.comm.activity.spans.append(("dp", a, clock.stamp()))
        clock.wait()            # the step's statistics read
        clock.now += 0.25       # its update
        monitor.end_step()
        if step % interval == 0:
            reports[step] = monitor.report(step)
    assert clock.waits == 0
    ends = [n for n in range(interval, 10, interval) if n > 1]  # intervals with counted steps
    assert ps.gathers == [n + 1 for n in ends if n + 1 <= 9]  # issued once their last step is in
    lag = max(interval, 2)
    read = {n + lag: n for n in ends if n + lag <= 9}
    assert [s for s, r in reports.items() if r is not None] == sorted(read)
    for at, n in read.items():
        first = max(2, n - interval + 1)
        r = reports[at]
        assert r.steps == (first, n)
        steps = range(first, n + 1)
        assert r.compute_s[0] == pytest.approx(sum(k - 0.5 + 0.25 for k in steps), abs=1e-4)
        assert r.blocked_s[0] == pytest.approx([0.0, 0.0, 0.0, 0.5 * len(steps), 0.0, 0.0],
                                               abs=1e-4)
        assert r.compute_s[1] == 1.0 and r.blocked_s[1] == [0.0, 0.0, 0.0, 0.5, 0.0, 0.0]
    assert monitor.last_report is reports[max(read)]
    # after the last step: the intervals still in flight (the newest ends at the last interval
    # step) are read at once, with their own sums
    final, n = monitor.finish(), max(ends)
    first = max(2, n - interval + 1)
    assert final.steps == (first, n) and monitor.last_report is final
    assert final.compute_s[0] == pytest.approx(sum(k - 0.25 for k in range(first, n + 1)), abs=1e-4)
    assert monitor.finish() is None                     # nothing left


def test_expert_waits_have_their_categories():
    """Expert-data-parallel waits (kind ``edp``: the expert gradients' reduction, ZeRO's expert
    gathers) count as dp; the expert-parallel dispatch (kind ``ep``) as ep; the rest as other."""
    from engine.observe.stragglers import CATEGORIES, StragglerMonitor
    clock, ps = _ScriptedClock(), _TwoRanks(_row(1.0))
    monitor = StragglerMonitor(ps, clock)
    for step in (1, 2, 3):  # step 1: the warm-up; step 2: the interval; step 3 adds it
        monitor.begin_step(step)
        for kind, seconds in (("edp", 0.5), ("dp_cp", 0.25), ("ep", 0.125), ("world", 0.0625)):
            a = clock.stamp()
            clock.now += seconds
            ps.comm.activity.spans.append((kind, a, clock.stamp()))
        clock.wait()
        monitor.end_step()
        if step == 2:
            monitor.report(step)
    report = monitor.finish()
    blocked = dict(zip(CATEGORIES, report.blocked_s[0]))
    assert report.steps == (2, 2)
    assert blocked == pytest.approx({"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.75, "ep": 0.125,
                                     "other": 0.0625}, abs=1e-4)


# ---- the whole path on 4 gloo ranks -------------------------------------------------------------
def _run(faults):
    from engine.training.trainer import Trainer
    # the report of steps 2-3 (step 1 is the warm-up) is the run's last interval: read after the
    # last step (one wait there) into step 3's record, which holds no other report
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
        # only in the last record (the interval's sums leave out step 1, the warm-up)
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
