"""A training step waits for the device at most once (engine/device/syncs.py): counted in strict
mode (every implicit read of a tensor, not only the engine's own waits), for each pipeline
schedule, ZeRO-1/2 with overlapped parameter all-gathers, gradient compression and context
parallelism, fp16's dynamic scale and the anomaly guard's fast path; validation with pp > 1 on the step's waiter; an extra read planted in the step is
seen (so the count can fail); the late figures are filled for every step, the last one too; the
straggler report at every step (--log-interval 1) adds no wait and still names a slowed rank.

One spawned group of four ranks runs every layout in turn (each a few steps).
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.config.cli import parse_args
from engine.device.clock import DeviceClock
from engine.device.syncs import SyncCounter
from engine.observe.faults import SlowRank
from engine.training.step_record import LATE_KEYS
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS = 3
BASE = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "8", "--micro-batch-size", "1",
        "--train-iters", str(STEPS), "--lr-warmup-iters", "0", "--log-interval", "100",
        "--host-sync-interval", "1"]
PP2 = ["--pp", "2", "--dp", "2"]
EVERY_STEP = ["--log-interval", "1", "--train-iters", "5"]  # (the later flag wins)
LAYOUTS = {
    "1f1b": PP2 + ["--pipeline-schedule", "1f1b", "--eval-interval", "2", "--eval-iters", "1"],
    "interleaved": PP2 + ["--pipeline-schedule", "interleaved", "--virtual-pipeline-size", "2"],
    "zb-h1": PP2 + ["--pipeline-schedule", "zb-h1"],
    "zb-v": PP2 + ["--pipeline-schedule", "zb-v"],
    "zero1-overlap": PP2 + ["--use-distributed-optimizer", "--overlap-param-gather"],
    "zero2-overlap": ["--dp", "4", "--use-distributed-optimizer", "--zero-stage", "2",
                      "--overlap-param-gather"],
    "int8": ["--dp", "4", "--grad-compression", "int8"],
    "topk": ["--dp", "4", "--grad-compression", "topk"],
    "cp2": ["--cp", "2", "--dp", "2"],
    # packed documents: the ids are checked where the batch is built, never per attention call
    "packed": ["--dp", "4", "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"],
    "fp16": PP2 + ["--precision", "fp16"],
    "guarded": ["--dp", "4", "--rerun-on-anomaly", "--spike-factor", "5"],  # a clean step's guard
}


def _train(argv, plant: bool = False, faults=()) -> dict:
    trainer = Trainer(parse_args(BASE + argv))
    for fault in faults:
        fault.install(trainer)
    trainer.clock.syncs.strict = True  # every aten scalar read too
    if plant:  # an extra read on the step's path: the count must see it
        statistics = trainer.stepper.statistics

        def statistics_with_a_read(local_loss, pipe):
            float(local_loss.detach().sum().item())
            return statistics(local_loss, pipe)
        trainer.stepper.statistics = statistics_with_a_read
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return {"syncs": [r["host_syncs"] for r in result.records],
            "points": [r["host_sync_points"] for r in result.records],
            "late_null": [[k for k in LATE_KEYS if r[k] is None and
                           not (k.startswith("bubble") and trainer.ps.pp_size == 1)
                           and k not in ("mfu", "hfu")]  # null without a known peak
                          for r in result.records],
            "valid": result.valid, "outside": trainer.clock.syncs.outside,
            "stragglers": [(r["straggler_rank"], r["straggler_waited_for"])
                           for r in result.records],
            "last_report": trainer.stragglers.last_report.steps
            if trainer.stragglers.last_report is not None else None}


def _all_layouts(ps) -> dict:
    out = {name: _train(argv) for name, argv in LAYOUTS.items()}
    out["planted"] = _train(PP2, plant=True)
    # the straggler report at every step, rank 1 slowed by 0.25 s per forward (2 per step): on a
    # loaded machine its peers' compute time stretches too, and 0.1 s was once not past 1.2x of it
    out["report-every-step"] = _train(["--dp", "4"] + EVERY_STEP,
                                      faults=[SlowRank(rank=1, seconds=0.25)])
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_layouts, grid=RankGrid(dp=4), deadline_s=900.0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_wait_per_step(runs, name):
    for rank, result in enumerate(runs):
        run = result[name]
        assert len(run["syncs"]) == STEPS, (name, rank, run)
        assert all(n == 1 for n in run["syncs"]), (name, rank, run["points"])
        assert all(p == ["statistics"] for p in run["points"]), (name, rank, run["points"])
        # the late figures of every step are filled, the last one's by the flush
        assert all(not missing for missing in run["late_null"]), (name, rank, run["late_null"])
        # between steps the engine waits only where it says: the clock's first anchor, the flush
        # after the last step and one read per validation batch (the straggler monitor, on by
        # default, reads each step's spans after the next step's wait and an interval's
        # all-gather after a later step's: none; at every step too, test_a_report_at_every_step...)
        assert run["outside"] == 2 + len(run["valid"]), (name, rank, run["outside"])


def test_validation_with_a_pipeline_reads_once_per_batch(runs):
    valid = [result["1f1b"]["valid"] for result in runs]
    assert all(v == valid[0] for v in valid) and len(valid[0]) == 1  # the same loss on every rank
    assert valid[0][0][1] > 0


def test_a_planted_read_is_counted(runs):
    for result in runs:
        run = result["planted"]
        assert run["syncs"] == [2] * STEPS, run["points"]
        assert all("tensor.item" in p for p in run["points"]), run["points"]


def test_a_report_at_every_step_adds_no_wait(runs):
    """--log-interval 1: the straggler monitor reads each step's stamps after the next step's wait
    and each interval's all-gather after a later one (engine/observe/stragglers.py), so no step
    waits for it (the old report waited at every step for the step just queued, counted here,
    then read its gather at once, counted nowhere); the report of step N, read at step N + 2,
    still names the slowed rank on every rank, and the last two, read after the last step, cost
    one wait there (the flush's, the anchor's and this one)."""
    for rank, result in enumerate(runs):
        run = result["report-every-step"]
        assert run["syncs"] == [1] * 5, (rank, run["points"])
        assert run["outside"] == 3, (rank, run["outside"])
        # step 1 is the warm-up: the reports of steps 2 and 3 land at steps 4 and 5
        assert run["stragglers"] == [(None, None)] * 3 + [(1, 1)] * 2, (rank, run["stragglers"])
        assert run["last_report"] == (5, 5), (rank, run["last_report"])


def test_counter_sees_implicit_reads_and_ignores_other_threads():
    import threading
    counter = SyncCounter(strict=True)
    t = torch.ones(3)
    with counter.step(), counter.watching():
        t.sum().item()
        bool(t.sum() > 0)
        t.tolist()
        t.to("cpu", non_blocking=True)   # no copy to wait for
        with counter.ignored():
            t.tolist()                   # a read known not to wait
        worker = threading.Thread(target=lambda: t.sum().item())
        worker.start()
        worker.join()                    # another thread's read is not this step's
    assert [e.name for e in counter.last] == ["tensor.item", "tensor.bool", "tensor.tolist"]
    assert torch.Tensor.item.__qualname__ != "blocking"  # unpatched after the block
    t.sum().item()
    assert counter.outside == 0


def test_clock_counts_waits_for_stamps_after_the_last_read():
    clock = DeviceClock("cpu")
    clock.anchor()
    a = clock.stamp()
    with clock.syncs.step():
        b = clock.stamp()
        clock.read(torch.zeros(2), "statistics")
        clock.elapsed_s(a, b)            # complete since the read: no wait
        c = clock.stamp()
        clock.elapsed_s(b, c)            # after the read: a GPU would wait for it
    assert [e.name for e in clock.syncs.last] == ["statistics", "event wait"]


def test_timeline_marks_the_wait(tmp_path):
    trace = tmp_path / "t.json"
    trainer = Trainer(parse_args(BASE[:-4] + ["--num-layers", "2", "--train-iters", "2",
                                             "--host-sync-interval", "1",
                                             "--timeline", str(trace)]))
    try:
        trainer.train()
    finally:
        trainer.close()
    events = json.loads(trace.read_text())["traceEvents"]
    marks = [e for e in events if e["ph"] == "i"]
    assert [(e["name"], e["args"]["step"]) for e in marks] == \
        [("host sync: statistics", 1), ("host sync: statistics", 2)]
    for step in (1, 2):  # after the backward, before the optimizer's span
        spans = {e["name"]: e for e in events if e["ph"] == "X" and e["args"]["step"] == step}
        mark = next(e for e in marks if e["args"]["step"] == step)
        assert spans["grad sync"]["ts"] <= mark["ts"] + 0.01
        assert mark["ts"] <= spans["optimizer"]["ts"] + 0.01


def test_the_dispatch_mode_counts_step_one_and_every_interval_th_step():
    """Where the dispatch mode counts (CPU), --host-sync-interval N counts step 1 and every N-th
    step, the others' host_syncs null; by default N is --log-interval."""
    from parallel.grid.launch import LaunchEnv
    serial = BASE[:-4]  # (without --log-interval 100 --host-sync-interval 1)
    assert "--host-sync-interval" not in serial and "--log-interval" not in serial
    for flags, want in ((["--train-iters", "7", "--host-sync-interval", "3"], [1, 3, 6]),
                        (["--train-iters", "5", "--log-interval", "2"], [1, 2, 4])):
        records = Trainer(parse_args(serial + flags), launch=LaunchEnv()).train().records
        counted = [i + 1 for i, r in enumerate(records) if r["host_syncs"] is not None]
        assert counted == want, (flags, counted)
        assert all(r["host_syncs"] == 1 for r in records if r["host_syncs"] is not None), flags
        assert all(r["host_sync_points"] is None for r in records if r["host_syncs"] is None), flags
