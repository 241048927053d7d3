"""The exposed-communication metrics of a pp=2 trainer run: ``time_pp_exposed_s`` and the replay
with transfers (``bubble_simulated`` against ``bubble_simulated_compute``), ``time_dp_exposed_s``
and ZeRO's ``time_zero_gather_exposed_s``, in every step record (the last one too), the summary
and the dashboards' scalars, with still one host wait per step.

One spawned group of four ranks (pp=2 x dp=2, interleaved with 2 chunks, the distributed
optimizer with overlapped parameter gathers) trains a tiny model for three steps. Timings are
noisy on a shared CPU: only exact properties are asserted (present, non-negative, the replay
with transfers never below the one without: costs only delay a replay).
"""
from __future__ import annotations

import pytest

from engine.config.cli import parse_args
from engine.observe.dashboards import scalars
from engine.observe.metrics import summarize_run
from engine.training.trainer import Trainer
from parallel.pipeline.bubble import theoretical_bubble
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS = 3
ARGV = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "8", "--micro-batch-size", "1",
        "--train-iters", str(STEPS), "--lr-warmup-iters", "0", "--log-interval", "100",
        "--pp", "2", "--dp", "2", "--pipeline-schedule", "interleaved",
        "--virtual-pipeline-size", "2", "--use-distributed-optimizer", "--overlap-param-gather"]
KEYS = ("time_pp_exposed_s", "time_dp_exposed_s", "time_zero_gather_exposed_s")


def _train(ps) -> list[dict]:
    trainer = Trainer(parse_args(ARGV))
    try:
        return trainer.train().records
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def records():
    return run_distributed(_train, grid=RankGrid(pp=2, dp=2), deadline_s=600.0)[0]


def test_every_record_has_the_exposed_times(records):
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    theory = theoretical_bubble("interleaved", 2, 4, 2)
    for r in records:
        for key in KEYS:
            assert isinstance(r[key], float) and r[key] >= 0.0, (key, r)
        assert r["host_syncs"] == 1, r["host_sync_points"]
        assert r["bubble_simulated_compute"] >= theory - 1e-9, r
        assert r["bubble_simulated"] >= r["bubble_simulated_compute"] - 1e-9, r


def test_summary_and_dashboards_carry_them(records):
    summary = summarize_run(records, warmup=1)
    tags = scalars(records[-1])
    for key in KEYS:
        assert summary[key] == pytest.approx(sum(r[key] for r in records[1:]) / (STEPS - 1))
        assert f"comm/{key}" in tags
    assert "pipeline/bubble_simulated_compute" in tags
