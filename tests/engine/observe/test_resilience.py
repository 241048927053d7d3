"""Resilience: bad steps re-run and attributed, stragglers and hangs named.

A NaN planted in one rank's gradient once (transient) is caught before the update, re-run from the
step's saved inputs and reported as transient, and the run's losses equal a run without the fault;
planted on every execution (persistent) it stops the run on every rank naming the step, rank,
micro-batch and parameter. A finite gradient far above the running median is a spike. Re-runs
restore 1-bit Adam's and DGC's momentum (the ZeRO seed shard included) and work under the
zero-bubble schedules; a run that stops keeps its records and publishes its save in flight.
Detection adds no collective to a step. A rank made slow is named as the straggler; a rank made to hang is
named by its peers, from their heartbeats, when the collective times out."""
import io
import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import engine.checkpoint.async_writer as async_writer
from engine.observe.anomaly import Finding, PersistentAnomaly, SpikeDetector
from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.observe.faults import GradFault, HangRank, Released, SlowRank
from engine.training.step import StepAgreement, exposed_times
from engine.observe.stragglers import StragglerReport
from engine.training.step_record import STRAGGLER_KEYS
from engine.training.launch import describe_comm_failure
from engine.training.trainer import Trainer
from parallel.runtime.comm_monitor import Activity
from parallel.runtime.heartbeat import Heartbeat, describe_peers
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import record_comm, run_distributed

TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "1", "--timeout-s", "60"]
PARAM = "layers.1.mlp.fc2.weight"


# ---- pure parts ---------------------------------------------------------------------------------
def test_spike_detector_worked_example():
    d = SpikeDetector(5.0, window=3)
    for v in (2.0, float("nan"), 2.2):
        d.accept(v)
    assert d.threshold() is None and not d.is_spike(1e9)  # two accepted values: not judged yet
    d.accept(2.1)
    assert d.threshold() == pytest.approx(10.5)
    assert d.is_spike(10.6) and not d.is_spike(10.4) and not d.is_spike(float("inf"))
    d.accept(100.0)  # the window keeps the last 3: [2.2, 2.1, 100] -> median 2.2
    assert d.threshold() == pytest.approx(11.0)
    assert not SpikeDetector(0.0).is_spike(1e30)


def test_spike_flags_are_checked():
    with pytest.raises(ConfigError, match="--spike-factor must be above 1"):
        parse_args(TINY + ["--spike-factor", "0.5"])
    with pytest.raises(ConfigError, match="--spike-window must be >= 1"):
        parse_args(TINY + ["--spike-window", "0"])


def test_finding_travels_as_int32_codes():
    f = Finding(3, True, False, 2, -1, 1, "layers.11.attn.qkv.weight")
    row = torch.tensor(f.encode(), dtype=torch.int32).tolist()
    assert Finding.decode(3, row) == f
    assert Finding.decode(0, Finding(0, False, False, 0, -1, -1, None).encode()).first_param is None


def test_step_agreement_splits_sums():
    a = StepAgreement()
    a.set("checkpoint", 3, lambda: [1, 0, 0])
    a.set("other", 2, lambda: [0, 1])
    assert a.local() == [1, 0, 0, 0, 1]
    assert a.split([1.0, 4.0, 0.0, 0.0, 2.0]) == {"checkpoint": [1, 4, 0], "other": [0, 2]}
    a.set("other", 2, lambda: [0])
    with pytest.raises(ValueError, match="other must give 2 non-negative integers"):
        a.local()


def test_straggler_report_formula():
    # rank 2 computes 0.9 s; the lower median of [0.3, 0.4, 0.9, 0.35] is 0.35; rank 2 waited least
    rows = [[0.3, 0.1, 0, 0, 0.5, 0, 0.1], [0.4, 0.1, 0, 0, 0.4, 0, 0.1],
            [0.9, 0, 0, 0, 0.05, 0, 0], [0.35, 0.1, 0, 0, 0.45, 0, 0.1]]
    r = StragglerReport.from_rows((1, 10), rows)
    assert (r.straggler_rank, r.waited_for) == (2, 2)
    assert r.straggler_ratio == pytest.approx(0.9 / 0.35)
    text = r.describe(RankGrid(tp=2, dp=2))
    assert "rank 2 (tp 0, pp 0, dp 1) computed 0.900 s, 2.57x the 0.350 s of its peers" in text
    assert "the others waited for rank 2 (tp 0, pp 0, dp 1)" in text


def test_describe_peers_sorts_members():
    now = 100.0
    beats = {0: {"t": 99.8, "step": 4, "entered": {"dp": 7}, "last": ["all_reduce", "dp", 7],
                 "blocked": ["all_reduce", "dp", 7, 95.0]},
             1: {"t": 99.5, "step": 4, "entered": {"dp": 5}, "last": ["all_reduce", "world", 9],
                 "blocked": None},
             2: {"t": 80.0, "step": 3, "entered": {"dp": 6}, "last": None, "blocked": None},
             3: None}
    text = describe_peers(("all_reduce", "dp", 7), [0, 1, 2, 3], beats, now, stale_s=4.0)
    assert text.startswith("all_reduce #7 of the dp group (ranks [0, 1, 2, 3]): entered by rank 0; "
                           "not entered by rank 1 (step 4, not in a collective, last entered "
                           "all_reduce #9 of world, heartbeat 0.5 s ago)"), text
    assert "rank 2 (step 3, not in a collective, heartbeat 20.0 s ago; silent since: dead or frozen)" in text
    assert "rank 3 (no heartbeat" in text
    text = describe_peers(("p2p", "pp", 12), [0, 1], beats, now, stale_s=4.0)
    assert text == ("point-to-point batch #12 of the pp group (ranks [0, 1]): rank 0 (step 4, "
                    "blocked in all_reduce #7 of dp for 5.0 s, last entered all_reduce #7 of dp, "
                    "heartbeat 0.2 s ago); rank 1 (step 4, not in a collective, last entered "
                    "all_reduce #9 of world, heartbeat 0.5 s ago)"), text


def two_heartbeats():
    """Two ranks' activities and heartbeats through one store, with a 0.5 s watchdog writing to
    the returned stream."""
    store = dist.HashStore()
    acts = [Activity(), Activity()]
    out = io.StringIO()
    beats = [Heartbeat(store, r, acts[r], {"dp": (0, 1)}, interval_s=0.1, watchdog_s=0.5, stream=out)
             for r in (0, 1)]
    return acts, beats, out


def test_heartbeat_through_a_store_and_its_watchdog():
    acts, beats, out = two_heartbeats()
    acts[1].step = 3
    acts[1].enter("all_reduce", "dp")
    beats[1].beat()
    acts[0].step = 3
    tag = acts[0].enter("all_reduce", "dp")
    tag = acts[0].enter("all_reduce", "dp")  # rank 0 is one collective ahead
    acts[0].blocked = (*tag, time.time() - 1.0)
    beats[0].beat()
    beats[0]._watch()
    text = out.getvalue()
    assert "rank 0 has been blocked for 1 s in all_reduce #2 of the dp group (ranks [0, 1]): " \
           "entered by rank 0; not entered by rank 1 (step 3, not in a collective, last entered " \
           "all_reduce #1 of dp" in text, text
    beats[0]._watch()
    assert out.getvalue() == text  # reported once per stuck collective


def test_a_workers_own_communicator_is_counted_apart():
    """Compressed steps issue DP collectives from the exchange worker on its own communicator
    while the main lane issues others on the dp group, interleaved differently on each rank.
    Counted together, rank 1 below (which entered the main lane's one collective and none of the
    exchange's) would count 1 of dp and pass as having entered the exchange's all-gather #1. Each
    lane is counted apart, so the heartbeat names who did not enter it."""
    acts, beats, out = two_heartbeats()
    acts[1].enter("all_reduce", "dp")                 # the main lane's collective only
    beats[1].beat()
    tag = acts[0].enter("all_gather", "dp", "dp-exchange")  # rank 0: exchange first
    assert tag == ("all_gather", "dp@dp-exchange", 1)
    acts[0].enter("all_reduce", "dp")
    acts[0].blocked = (*tag, time.time() - 1.0)
    beats[0].beat()
    beats[0]._watch()
    text = out.getvalue()
    assert "blocked for 1 s in all_gather #1 of the dp group on its dp-exchange lane (ranks [0, 1]): " \
           "entered by rank 0; not entered by rank 1 (step 0, not in a collective, last entered " \
           "all_reduce #1 of dp, heartbeat" in text, text
    assert acts[0].entered == {**{k: 0 for k in acts[0].entered if "@" not in k and k != "dp"},
                               "dp": 1, "dp@dp-exchange": 1}


# ---- re-runs on 2 ranks -------------------------------------------------------------------------
class ScaledLoss:
    """Test fault: ``rank``'s first chunk's output times ``factor`` in step ``step``'s first
    execution only (transient): a loss spike (finite) or a non-finite loss."""

    def __init__(self, rank: int, step: int, factor: float):
        self.rank, self.step, self.factor, self.calls = rank, step, factor, 0

    def install(self, trainer):
        if trainer.ps.rank == self.rank:
            trainer.chunks[0].register_forward_hook(lambda m, args, out: self._hook(trainer, out))
        return self

    def _hook(self, trainer, out):
        if trainer.stepper.current_step != self.step:
            return out
        self.calls += 1  # one forward per micro-batch and execution
        return out * self.factor if self.calls <= trainer.num_micro else out


class ExposedPerExecution:
    """Test probe: the exposed communication times of every execution of step ``step`` (its
    re-run's too), from the stamps each execution hands the step's record."""

    def __init__(self, step: int):
        self.step, self.runs = step, []

    def install(self, trainer):
        stepper, compute = trainer.stepper, trainer.stepper.compute

        def probed(batches):
            pre = compute(batches)
            if stepper.current_step == self.step:
                self.runs.append(exposed_times(stepper.clock, pre.waits))
            return pre
        stepper.compute = probed
        return self


def _train(argv, faults=(), keep=False):
    trainer = Trainer(parse_args(argv))
    for fault in faults:
        fault.install(trainer)
    try:
        result = trainer.train()
        return result.records, trainer.guard, trainer
    finally:
        if not keep:
            trainer.close()


def bad_steps(ps, root):
    out = {}
    base = TINY + ["--train-iters", "4", "--dropout", "0.1"]  # the re-run must restore the RNG
    guarded = base + ["--rerun-on-anomaly"]
    # no collective is added to a step by the guard
    events = {}
    for name, argv in (("plain", base), ("guarded", guarded)):
        trainer = Trainer(parse_args(argv))
        with record_comm(trainer.ps) as ev:
            trainer.stepper.run(trainer._batches(0), 1e-3, 1)
        events[name] = [(e.op, e.group, e.dtype, e.payload_bytes) for e in ev]
        trainer.close()
    out["events"] = events
    calls = []
    real_agree = async_writer.agree
    async_writer.agree = lambda ps, counts: calls.append(counts) or real_agree(ps, counts)
    try:
        records, _, _ = _train(base)
    finally:
        async_writer.agree = real_agree
    out["clean"], out["agree_calls"] = [r["loss"] for r in records], len(calls)
    fault = GradFault(rank=1, step=2, param=PARAM, micro_batch=1)
    records, guard, _ = _train(guarded, [fault])
    out["transient"] = ([r["loss"] for r in records], [(r["anomaly"], r["rerun"]) for r in records],
                        guard.anomalies[0].describe(guard.ps.grid), fault.planted)
    # under ZeRO-1 with the overlapped gather: the re-run step's exposed waits are both executions'
    probe = ExposedPerExecution(step=2)
    records, _, _ = _train(guarded + ["--use-distributed-optimizer"],
                           [GradFault(rank=1, step=2, param=PARAM, micro_batch=1), probe])
    out["exposed"] = (probe.runs, {k: records[1][k] for k in probe.runs[0]}, records[1]["rerun"])
    fault = GradFault(rank=1, step=3, param=PARAM, micro_batch=1, repeat=True)
    try:
        _train(guarded, [fault])
        out["persistent"] = "no error"
    except PersistentAnomaly as exc:
        out["persistent"] = str(exc)
    # a finite gradient 1e6 times too large at step 6: a gradient-norm spike, transient
    spiky = TINY + ["--train-iters", "6", "--rerun-on-anomaly", "--spike-factor", "10"]
    out["spike_clean"] = [r["loss"] for r in _train(spiky)[0]]
    records, guard, _ = _train(spiky, [GradFault(rank=0, step=6, param="layers.0.attn.qkv.weight",
                                                 value=1e6)])
    out["spike"] = ([r["loss"] for r in records], records[-1]["anomaly"], records[-1]["rerun"])
    # pipeline: rank 0 is stage 0; its gradient of micro-batch 0 is bad on every execution
    fault = GradFault(rank=0, step=2, param="layers.0.attn.qkv.weight", micro_batch=0, repeat=True)
    try:
        _train(guarded + ["--pp", "2"], [fault])
        out["pipeline"] = "no error"
    except PersistentAnomaly as exc:
        out["pipeline"] = str(exc)
    out.update(**compressed_reruns(), **zero_bubble_reruns(), **stopped_run(ps, root),
               **final_reports(root))
    return out


def _losses_and_reruns(argv, faults=()):
    records = _train(argv, faults)[0]
    return [r["loss"] for r in records], [r["rerun"] for r in records]


def compressed_reruns():
    """Under ZeRO-1, step 4 is the first compressed step: 1-bit Adam's and DGC's momentum is
    seeded as this rank's shard of exp_avg, gathered by the step's exchange. A spike in its first
    execution (rank 0's gradient 1e6 too large; a loss 100x too large) is transient: the re-run
    starts from the seed again, not from the momentum the first execution advanced."""
    out = {}
    base = TINY + ["--train-iters", "5", "--rerun-on-anomaly", "--spike-factor", "10",
                   "--use-distributed-optimizer", "--zero-stage", "1",
                   "--grad-compression-warmup-steps", "3", "--grad-compression"]
    for name, fault in (("onebit", GradFault(rank=0, step=4, param="layers.0.attn.qkv.weight",
                                             value=1e6)),
                        ("topk", ScaledLoss(rank=0, step=4, factor=100.0))):
        out[name] = (_losses_and_reruns(base + [name]),
                     _losses_and_reruns(base + [name], [fault]))
    return out


def zero_bubble_reruns():
    """zb-h1 and zb-v at pp=2: a weight whose gradient waits for the W action reaches the
    probe's and GradFault's tensor hooks as None, and is checked and planted where W
    accumulates it."""
    out = {}
    base = TINY + ["--train-iters", "4", "--rerun-on-anomaly", "--pp", "2", "--pipeline-schedule"]
    h1, v = base + ["zb-h1"], base + ["zb-v", "--num-layers", "4"]
    out["zb-h1 clean"], out["zb-v clean"] = _losses_and_reruns(h1), _losses_and_reruns(v)
    fault = GradFault(rank=1, step=2, param=PARAM, micro_batch=1)  # W-deferred, on stage 1
    out["zb-h1 transient"] = (*_losses_and_reruns(h1, [fault]), fault.planted)
    out["zb-v transient"] = _losses_and_reruns(v, [ScaledLoss(rank=1, step=2,
                                                              factor=float("nan"))])
    try:
        _train(h1, [GradFault(rank=1, step=2, param=PARAM, micro_batch=1, repeat=True)])
        out["zb-h1 persistent"] = "no error"
    except PersistentAnomaly as exc:
        out["zb-h1 persistent"] = str(exc)
    return out


def stopped_run(ps, root):
    """A persistent NaN at step 3 while the background save of step 2 is written but not yet
    published: the run stops with every record of the steps before it and the failing step's,
    and with step 2 published and named."""
    save, metrics = os.path.join(root, "ck"), os.path.join(root, "metrics.jsonl")
    argv = TINY + ["--train-iters", "6", "--rerun-on-anomaly", "--save", save, "--save-interval",
                   "2", "--async-save", "--metrics-file", metrics]
    try:
        _train(argv, [GradFault(rank=1, step=3, param=PARAM, micro_batch=1, repeat=True)])
        message = "no error"
    except PersistentAnomaly as exc:
        message = str(exc)
    records = None
    if ps.rank == 0:  # (the metrics file is rank 0's)
        with open(metrics) as fh:
            records = [json.loads(line) for line in fh]
    return {"stopped": (message, os.path.realpath(os.path.join(save, "latest")),
                        os.path.join(save, "iter_0000002"), records)}


class StopAt:
    """Test fault: ``rank`` gets SIGTERM during step ``step`` (before its statistics all-reduce,
    which carries the stop to every rank)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def install(self, trainer):
        def hook(module, args, out):
            if trainer.stepper.current_step == self.step:
                trainer.stop_signal = signal.SIGTERM
        if trainer.ps.rank == self.rank:
            trainer.chunks[0].register_forward_hook(hook)
        return self


def final_reports(root):
    """Runs that end with a synchronous save, which publishes the last record before the run's
    end: at --train-iters (3 steps, --log-interval 2: the report of steps 2-2 lands in step 3's
    record, off the interval) and stopped by SIGTERM on rank 1 in step 2. The last records, as
    returned and as in the metrics file."""
    out = {}
    for name, steps, faults in (("ended", "3", []), ("stopped", "6", [StopAt(rank=1, step=2)])):
        metrics = os.path.join(root, f"{name}.jsonl")
        argv = TINY + ["--train-iters", steps, "--log-interval", "2", "--save",
                       os.path.join(root, f"ck-{name}"), "--metrics-file", metrics,
                       "--tensorboard-dir", os.path.join(root, f"tb-{name}")]
        records = _train(argv, faults)[0]
        written = None
        if os.path.exists(metrics):  # (rank 0's)
            with open(metrics) as fh:
                written = [json.loads(line) for line in fh]
        out[name] = {"records": records, "written": written,
                     "tensorboard": os.path.join(root, f"tb-{name}")}
    return {"final": out}


@pytest.fixture(scope="module")
def reruns(tmp_path_factory):
    """Every re-run case above and the runs ending with a save, on one spawned group of 2
    ranks."""
    root = str(tmp_path_factory.mktemp("rerun"))
    return run_distributed(bad_steps, grid=RankGrid(dp=2), args=(root,), timeout_s=120)


def test_bad_steps_rerun_and_attribution(reruns):
    res = reruns
    for rank in (0, 1):
        r = res[rank]
        plain, guarded = r["events"]["plain"], r["events"]["guarded"]
        # the guard judges the loss and norm the statistics all-reduce already agreed: it adds
        # no collective and no byte to a step
        assert plain[-1][:2] == ("all_reduce", "world")
        assert guarded == plain, r["events"]
        assert r["agree_calls"] == 0  # the checkpointer's counters rode on the statistics
        losses, marks, text, planted = r["transient"]
        assert losses == r["clean"], (losses, r["clean"])  # exactly the fault-free run
        assert marks[1] == ("non-finite gradient norm", "transient")
        assert marks[0] == marks[2] == marks[3] == (None, None)
        assert "step 2: non-finite gradient norm; run again from the step's saved inputs: it did " \
               "not repeat: transient" in text, text
        assert "rank 1 (tp 0/1, pp 0/1, dp 1/2): micro-batch unknown" in text, text
        assert f"first non-finite gradient {PARAM} (1 parameter non-finite before the " \
               f"data-parallel reduction)" in text and "rank 0" not in text, text
        assert planted == (1 if rank == 1 else 0)
        text = r["persistent"]
        assert "step 3: non-finite gradient norm; run again from the step's saved inputs: it " \
               "repeated (non-finite gradient norm): persistent" in text, text
        assert f"rank 1 (tp 0/1, pp 0/1, dp 1/2): micro-batch 1, first non-finite gradient {PARAM}" in text, text
        assert "The run stops; last good checkpoint: none saved" in text
        losses, why, verdict = r["spike"]
        assert losses == r["spike_clean"] and verdict == "transient", r["spike"]
        assert why.startswith("gradient-norm spike (") and "> --spike-factor 10 x the median" in why
        text = r["pipeline"]
        assert "step 2: non-finite gradient norm" in text and "persistent" in text, text
        assert "rank 0 (tp 0/1, pp 0/2, dp 0/1): micro-batch 0, first non-finite gradient " \
               "layers.0.attn.qkv.weight" in text and "rank 1 (" not in text, text


def test_a_rerun_steps_exposed_times_hold_both_executions(reruns):
    """The step's traffic and forward-backward time count both executions of a re-run step, so
    its exposed DP and ZeRO-gather waits do too: each figure is the sum of the two executions'."""
    for rank in (0, 1):
        runs, record, verdict = reruns[rank]["exposed"]
        assert verdict == "transient" and len(runs) == 2, (verdict, runs)
        assert set(record) >= {"time_dp_exposed_s", "time_zero_gather_exposed_s"}, record
        for key, value in record.items():
            if runs[0][key] is None:
                assert value is None and runs[1][key] is None, (key, runs)
                continue
            assert value == pytest.approx(runs[0][key] + runs[1][key], rel=1e-9, abs=1e-12), \
                (key, value, runs)
        assert runs[0]["time_zero_gather_exposed_s"] is not None, runs
        assert runs[0]["time_dp_exposed_s"] > 0 and runs[1]["time_dp_exposed_s"] > 0, runs


def test_a_rerun_restores_the_compressed_momentum(reruns):
    for rank in (0, 1):
        for name in ("onebit", "topk"):
            (clean, _), (losses, marks) = reruns[rank][name]
            assert losses == clean, (name, losses, clean)  # exactly the fault-free run
            assert marks == [None, None, None, "transient", None], (name, marks)


def test_zero_bubble_schedules_rerun(reruns):
    for rank in (0, 1):
        r = reruns[rank]
        losses, marks, planted = r["zb-h1 transient"]
        assert (losses, marks) == (r["zb-h1 clean"][0], [None, "transient", None, None])
        assert planted == (1 if rank == 1 else 0)  # into W's gradient, once
        assert r["zb-v transient"] == (r["zb-v clean"][0], [None, "transient", None, None])
        text = r["zb-h1 persistent"]
        assert "step 2: non-finite gradient norm" in text and "persistent" in text, text
        assert f"rank 1 (tp 0/1, pp 1/2, dp 0/1): micro-batch 1, first non-finite gradient " \
               f"{PARAM} (1 parameter" in text, text


def test_a_stopped_run_keeps_its_records(reruns):
    message, _, _, records = reruns[0]["stopped"]
    assert "step 3: non-finite gradient norm" in message and "persistent" in message, message
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["step_time_s"] is not None and records[1]["rerun"] is None  # late keys in
    assert records[2]["rerun"] == "persistent" and records[2]["skipped"] is True
    assert records[2]["anomaly"] == "non-finite gradient norm"
    assert records[2]["step_time_s"] is None  # (not known: the step stopped the run)


def test_a_stopped_run_publishes_the_save_in_flight(reruns):
    for rank in (0, 1):
        message, latest, step2, _ = reruns[rank]["stopped"]
        assert latest == step2  # written by both ranks before step 3 failed: published
        assert message.endswith(f"The run stops; last good checkpoint: {step2}"), message


def test_the_last_report_reaches_a_run_ending_with_a_save(reruns):
    """The report read after the last step reaches the last record although the save of that
    step publishes it first: in the records returned, the metrics file and the dashboards (also
    on a step that is not an interval step)."""
    for name, last in (("ended", 3), ("stopped", 2)):
        for rank in (0, 1):
            records = reruns[rank]["final"][name]["records"]
            assert [r["step"] for r in records] == list(range(1, last + 1))
            assert all(r[k] is None for r in records[:-1] for k in STRAGGLER_KEYS), records
            assert records[-1]["straggler_ratio"] is not None, (name, rank, records[-1])
            assert records[-1]["straggler_waited_for"] in (0, 1)
        final = reruns[0]["final"][name]
        assert [r["step"] for r in final["written"]] == [r["step"] for r in final["records"]]
        assert [final["written"][-1][k] for k in STRAGGLER_KEYS] == \
            [final["records"][-1][k] for k in STRAGGLER_KEYS]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(reruns[0]["final"]["ended"]["tensorboard"])
    acc.Reload()
    ratio = reruns[0]["final"]["ended"]["records"][-1]["straggler_ratio"]
    assert [(e.step, e.value) for e in acc.Scalars("stragglers/straggler_ratio")] == \
        [(3, pytest.approx(ratio, rel=1e-6))]
    assert [e.step for e in acc.Scalars("train/loss")] == [2]   # every --log-interval steps


# ---- stragglers and hangs -----------------------------------------------------------------------
def slow_rank(ps):
    argv = TINY + ["--train-iters", "2", "--log-interval", "2"]
    out = []
    # dp=2: rank 1's peer waits in the DP reduction; pp=2: stage 1 (rank 1) waits in its
    # receives for stage 0 (rank 0), which must then count as wait, not as rank 1's compute
    for extra, slow in (([], SlowRank(rank=1, seconds=0.4)), (["--pp", "2"], SlowRank(rank=0, seconds=0.2))):
        records, _, _ = _train(argv + extra, [slow])
        out.append([(r["straggler_rank"], r["straggler_ratio"], r["straggler_waited_for"])
                    for r in records])
    return out


def hung_rank(ps, release):
    trainer = Trainer(parse_args(TINY + ["--train-iters", "3", "--timeout-s", "3"]))
    HangRank(rank=1, step=2, release=release).install(trainer)
    start = time.perf_counter()
    try:
        trainer.train()
    except Released:
        return "released", None
    except RuntimeError as exc:
        message = describe_comm_failure(exc, trainer.ps, 3.0)
        waited = time.perf_counter() - start
        open(release, "w").close()
        return message, waited
    finally:
        trainer.heartbeat.stop()
    return "no error", None


def test_straggler_and_hang_are_named(tmp_path):
    res = run_distributed(slow_rank, grid=RankGrid(dp=2), timeout_s=120)
    for rank in (0, 1):
        (dp_first, dp_report), (pp_first, pp_report) = res[rank]
        assert dp_first == pp_first == (None, None, None)  # reports every --log-interval steps
        assert (dp_report[0], dp_report[2]) == (1, 1), res[rank]
        # pp=2, dp=1: a stage has no peer doing its work, so no straggler; stage 1 waited for 0
        assert (pp_report[0], pp_report[2]) == (None, 0), res[rank]
    res = run_distributed(hung_rank, grid=RankGrid(dp=2), args=(str(tmp_path / "release"),),
                          timeout_s=60)
    assert res[1] == ("released", None)
    message, waited = res[0]
    assert waited < 12, waited  # step 1, then the 3 s timeout of step 2's DP reduction
    assert "over the dp group (ranks [0, 1]) in GradReducer.finish" in message, message
    assert "Heartbeats: all_reduce #" in message and "of the dp group (ranks [0, 1]): entered by " \
           "rank 0; not entered by rank 1 (step 2, not in a collective" in message, message
