"""The exposed-communication metrics of a trainer run: ``time_pp_exposed_s`` and the replay with
transfers (``bubble_simulated`` against ``bubble_simulated_compute``), ``time_dp_exposed_s`` and
ZeRO's ``time_zero_gather_exposed_s``, in every step record (the last one too), the summary and
the dashboards' scalars, with still one host wait per step.

One spawned group of four ranks trains a tiny model for three steps twice: pp=2 x dp=2,
interleaved with 2 chunks, the distributed optimizer with overlapped parameter gathers; then
pp=4 x dp=1 (1F1B, no ZeRO); then for two steps at dp=4 under ZeRO-1 and ZeRO-3 without the
overlapped gather and ZeRO-3 with it. Timings on a shared CPU are noisy, so the test makes the waits it
checks long and known: every wait for a DP collective (the reducer's buckets, ZeRO's parameter
gathers) and every pipeline wait returns DELAY_S after the real one, and the test counts them.
What each figure must then be:

- ``time_dp_exposed_s`` (global rank 0): exactly the seconds between the stamps the reducer took
  around its wait in ``finish`` this step, and at least DELAY_S per collective waited for there;
  0.0 exactly at dp=1, where nothing is in flight;
- ``time_zero_gather_exposed_s``: exactly the sum of the gather's stamped waits of the step, at
  least DELAY_S per gather waited for; 0.0 exactly in step 1, whose forward finds no gather in
  flight (the first parameters need none); null without ZeRO's overlapped gathers (no ZeRO,
  ``--no-overlap-param-gather``); under ZeRO-3 with them, above 0.0 from step 1 on (its gathers are
  issued inside the step);
- ``time_pp_exposed_s`` (the world mean): each receive's wait ends DELAY_S after its message
  arrived, all of it exposed, so the mean is at least 0.95 DELAY_S per receive waited for; and
  being inside each rank's pipeline phase, it is no more than global rank 0's, the first stage's,
  which starts the pipeline and ends it (``time_forward_backward_s``);
- the replay with transfers is never below the one without (costs only delay a replay), which is
  never below the schedule's theoretical bubble;
- ``bubble_simulated_compute`` is the schedule (built here) replayed with free transfers and, per
  stage, the mean of the step's forward and of its backward spans over the stage's ranks, each
  rank's taken here from that step's own pipeline events: the right step, the right stage; the
  per-stage means the record carries are those, and ``bubble_simulated`` is the replay of them
  with the record's measured transfer costs.
"""
from __future__ import annotations

import time

import pytest

from engine.config.cli import parse_args
from engine.observe.dashboards import scalars
from engine.observe.metrics import summarize_run
from engine.training.trainer import Trainer
from parallel.pipeline.bubble import simulate, theoretical_bubble
from parallel.pipeline.schedules import build_schedule, has_weight_actions
from parallel.pipeline.transfers import StageTransfers
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS = 3
DELAY_S = 0.02
BASE = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "8", "--micro-batch-size", "1",
        "--train-iters", str(STEPS), "--lr-warmup-iters", "0", "--log-interval", "100",
        "--host-sync-interval", "1"]
INTERLEAVED = BASE + ["--pp", "2", "--dp", "2", "--pipeline-schedule", "interleaved",
                      "--virtual-pipeline-size", "2", "--use-distributed-optimizer",
                      "--overlap-param-gather"]
DEEP = BASE + ["--pp", "4", "--dp", "1"]
KEYS = ("time_pp_exposed_s", "time_dp_exposed_s", "time_zero_gather_exposed_s")
# what a step's output carries for the replays (filled one step late)
REPLAY_KEYS = ("stage_fwd_s", "stage_bwd_s", "stage_wgt_s", "stage_post_s", "stage_latency_f_s",
               "stage_latency_b_s")


class Delayed:
    """An asynchronous DP collective's handle: ``wait()`` returns DELAY_S after the collective's,
    and logs in which wait (``phase[0]``) it ran."""

    def __init__(self, work, log: list, phase: list):
        self.work, self.log, self.phase = work, log, phase

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        time.sleep(DELAY_S)
        self.log.append(self.phase[0])
        return result

    def __getattr__(self, name):
        return getattr(self.work, name)


class DelayedWaiter:
    """The pipeline's waiter, each wait DELAY_S longer; counts the waits for receives only."""

    def __init__(self, waiter, counts: dict):
        self.waiter, self.counts, self.mode = waiter, counts, waiter.mode

    def wait(self, ps, works, transfers, timeout_s, vp, posted_at=None) -> None:
        self.waiter.wait(ps, works, transfers, timeout_s, vp, posted_at=posted_at)
        time.sleep(DELAY_S)
        self.counts["pp_recv"] += all(t.op == "recv" for t in transfers)


def delay_group(group, log: list, phase: list) -> None:
    """Every asynchronous collective of ``group`` (the reducer's) hands back a Delayed handle."""
    for name in ("all_reduce", "reduce_scatter_into", "all_gather_into"):
        def call(*args, _real=getattr(group, name), **kwargs):
            work = _real(*args, **kwargs)
            return None if work is None else Delayed(work, log, phase)
        setattr(group, name, call)


def in_phase(phase: list, name: str, fn):
    def call(*args, **kwargs):
        phase[0] = name
        try:
            return fn(*args, **kwargs)
        finally:
            phase[0] = None
    return call


def _train(ps, argv: list[str]) -> dict:
    """Train with the delays; per step: the waits counted, the stamps the reducer and the gather
    took around their waits, converted to seconds by the run's clock after the run."""
    trainer = Trainer(parse_args(argv))
    stepper, reducer = trainer.stepper, trainer.reducer
    gather, phase, log = stepper.param_gather, [None], []
    counts = {"pp_recv": 0}
    delay_group(reducer.group, log, phase)
    reducer.finish = in_phase(phase, "finish", reducer.finish)
    if gather is not None:
        gather.wait = in_phase(phase, "gather", gather.wait)
    if stepper.waiter is not None:
        stepper.waiter = DelayedWaiter(stepper.waiter, counts)
    steps, outs, run, pp_rank = [], [], stepper.run, trainer.ps.pp_rank

    def counted_run(*args, **kwargs):
        log.clear()
        counts.update(pp_recv=0)
        out = run(*args, **kwargs)
        spans = {cat: [e.end - e.start for e in out.pipeline.events if e.cat == cat]
                 for cat in ("forward", "backward")}
        steps.append({"dp_waits": log.count("finish"), "gather_waits": log.count("gather"),
                      "dp_stamps": reducer.wait_stamps, **counts,
                      "gather_stamps": None if gather is None else list(gather.waited),
                      "compute_s": [sum(v) / len(v) for v in spans.values()]})
        outs.append(out)
        return out

    stepper.run = counted_run
    try:
        records = trainer.train().records
    finally:
        trainer.close()
    clock = stepper.clock
    for s, out in zip(steps, outs):
        s["replay"] = {k: out.extra.get(k) for k in REPLAY_KEYS}
        pairs = s.pop("dp_stamps"), s.pop("gather_stamps")
        s["dp_s"] = 0.0 if pairs[0] is None else clock.elapsed_s(*pairs[0])
        s["gather_s"] = None if pairs[1] is None else sum(clock.elapsed_s(a, b) for a, b in pairs[1])
    return {"records": records, "steps": steps, "pp_rank": pp_rank}


def _gathers(argv: list[str]) -> tuple:
    """Rank 0's ``time_zero_gather_exposed_s`` per step of a run without the delays, and the
    summary's."""
    trainer = Trainer(parse_args(argv))
    try:
        records = trainer.train().records
    finally:
        trainer.close()
    key = "time_zero_gather_exposed_s"
    return [r[key] for r in records], summarize_run(records, warmup=1)[key]


def _both(ps) -> dict:
    out = {"interleaved": _train(ps, INTERLEAVED), "deep": _train(ps, DEEP)}
    # ZeRO-1 and ZeRO-3 with their gathers waited for inside the update or where issued (no
    # overlap), and ZeRO-3 overlapped: two steps of a two-layer model over dp=4
    zero = BASE + ["--dp", "4", "--num-layers", "2", "--train-iters", "2",
                   "--use-distributed-optimizer"]
    out["zero"] = {name: _gathers(zero + extra) for name, extra in (
        ("zero1 no overlap", ["--no-overlap-param-gather"]),
        ("zero3 no overlap", ["--zero-stage", "3", "--no-overlap-param-gather"]),
        ("zero3 overlap", ["--zero-stage", "3"]))}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both, grid=RankGrid(pp=2, dp=2), deadline_s=600.0)


def assert_pp_exposed(runs: list[dict], name: str) -> None:
    """The world mean of the ranks' exposed pipeline time against each rank's counted waits."""
    for k in range(STEPS):
        record = runs[0][name]["records"][k]
        got, phase = record["time_pp_exposed_s"], record["time_forward_backward_s"]
        counted = [r[name]["steps"][k] for r in runs]
        low = sum(0.95 * DELAY_S * c["pp_recv"] for c in counted) / len(counted)
        assert min(c["pp_recv"] for c in counted) >= 1, counted
        assert low <= got <= phase, (name, k + 1, got, low, phase)


def test_exposed_times_are_the_waits(runs):
    rank0 = runs[0]["interleaved"]
    records, steps = rank0["records"], rank0["steps"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and len(steps) == STEPS
    for r, s in zip(records, steps):
        assert r["time_dp_exposed_s"] == pytest.approx(s["dp_s"], rel=1e-12, abs=0), (r, s)
        assert r["time_dp_exposed_s"] >= DELAY_S * s["dp_waits"] and s["dp_waits"] >= 1, s
        assert r["time_zero_gather_exposed_s"] == pytest.approx(s["gather_s"], rel=1e-12, abs=0)
        assert r["time_zero_gather_exposed_s"] >= DELAY_S * s["gather_waits"], s
    assert steps[0]["gather_waits"] == 0 and records[0]["time_zero_gather_exposed_s"] == 0.0
    assert all(s["gather_waits"] >= 1 for s in steps[1:]), steps
    assert_pp_exposed(runs, "interleaved")
    deep = runs[0]["deep"]
    for r, s in zip(deep["records"], deep["steps"]):   # dp=1, no ZeRO: nothing in flight
        assert (r["time_dp_exposed_s"], s["dp_waits"]) == (0.0, 0), (r, s)
        assert r["time_zero_gather_exposed_s"] is None, r
    assert_pp_exposed(runs, "deep")


def test_zero_gather_exposed_is_null_without_the_overlapped_gather(runs):
    zero = runs[0]["zero"]
    assert zero["zero1 no overlap"] == zero["zero3 no overlap"] == ([None, None], None), zero
    # ZeRO-3 issues its gathers inside the step (the forward's and the backward's), so its first
    # step waits for some too
    steps, summary = zero["zero3 overlap"]
    assert all(x is not None and x > 0 for x in steps) and summary == steps[1], zero


def stage_means(runs: list[dict], name: str, k: int, pp: int) -> tuple[list, list]:
    """Per stage, the mean over its ranks of each rank's mean forward and backward span in step
    ``k`` (0-based)."""
    fwd, bwd = [0.0] * pp, [0.0] * pp
    for r in runs:
        f, b = r[name]["steps"][k]["compute_s"]
        fwd[r[name]["pp_rank"]] += f * pp / len(runs)
        bwd[r[name]["pp_rank"]] += b * pp / len(runs)
    return fwd, bwd


def test_replay_bubbles_and_one_host_wait(runs):
    for name, (pp, m, vp) in (("interleaved", (2, 4, 2)), ("deep", (4, 8, 1))):
        schedule = "interleaved" if vp > 1 else "1f1b"
        theory = theoretical_bubble(schedule, pp, m, vp)
        lists = build_schedule(schedule, pp, m, vp)
        assert not has_weight_actions(lists)
        assert sorted(r[name]["pp_rank"] for r in runs) == sorted(list(range(pp)) * (4 // pp))
        for k, r in enumerate(runs[0][name]["records"]):
            assert r["host_syncs"] == 1, r["host_sync_points"]
            assert r["bubble_simulated_compute"] >= theory - 1e-9, r
            assert r["bubble_simulated"] >= r["bubble_simulated_compute"] - 1e-9, r
            # the replays of this step's own stage means (fp32 in the statistics all-reduce)
            fwd, bwd = stage_means(runs, name, k, pp)
            carried = runs[0][name]["steps"][k]["replay"]
            assert carried["stage_fwd_s"] == pytest.approx(fwd, rel=1e-5), (name, k, carried, fwd)
            assert carried["stage_bwd_s"] == pytest.approx(bwd, rel=1e-5), (name, k, carried, bwd)
            compute = simulate(lists, fwd, bwd).idle_fraction
            assert r["bubble_simulated_compute"] == pytest.approx(compute, abs=1e-5), (name, k, r, compute)
            p2p, post = StageTransfers(carried["stage_post_s"], carried["stage_latency_f_s"],
                                       carried["stage_latency_b_s"]).costs(lists)
            replayed = simulate(lists, carried["stage_fwd_s"], carried["stage_bwd_s"], p2p,
                                None, post).idle_fraction
            assert r["bubble_simulated"] == pytest.approx(replayed, rel=1e-12), (name, k, r, replayed)


def test_summary_and_dashboards_carry_them(runs):
    records = runs[0]["interleaved"]["records"]
    summary = summarize_run(records, warmup=1)
    tags = scalars(records[-1])
    for key in KEYS:
        assert summary[key] == pytest.approx(sum(r[key] for r in records[1:]) / (STEPS - 1))
        assert f"comm/{key}" in tags
    assert "pipeline/bubble_simulated_compute" in tags
