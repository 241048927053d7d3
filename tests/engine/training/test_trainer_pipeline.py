"""What the trainer reports about its pipeline: bubble metrics, the Chrome-trace timeline, the number
of micro-batches in flight, and the early failure of an interleaved layout it cannot run.

One spawned group (pp=2 x dp=2, four ranks) trains GPipe, 1F1B and interleaved for a few steps with
``--metrics-file`` and ``--timeline``; the checks run on what the ranks return and on the files.
"""
from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.trainer import TIMELINE_STEPS, Trainer
from parallel.pipeline.bubble import measured_bubble
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS = 4
PP, DP = 2, 2
PEAK = 2.0  # --peak-tflops
BASE = ["--mock-data", "--vocab-size", "512", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--global-batch-size", "12", "--train-iters", str(STEPS),
        "--lr-warmup-iters", "0", "--peak-tflops", str(PEAK)]
LAYOUT = ["--pp", str(PP), "--dp", str(DP)]
# (schedule, micro-batch size, vp): m = 12 / (mbs * dp) micro-batches per step
RUNS = [("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved", 3, 2)]


def expected_in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Peak (micro-batch, chunk) activations held by a pipeline rank, from each schedule's design."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)   # Megatron's interleaved warm-up
    return min(warmup + 1, m * v)


def train_with_files(ps, runs: list, folder: str) -> list[dict]:
    out = []
    for schedule, mbs, vp in runs:
        argv = BASE + LAYOUT + ["--pipeline-schedule", schedule, "--micro-batch-size", str(mbs),
                       "--virtual-pipeline-size", str(vp),
                       "--metrics-file", f"{folder}/{schedule}.jsonl",
                       "--timeline", f"{folder}/{schedule}.trace.json"]
        trainer = Trainer(parse_args(argv))
        peaks, run = [], trainer.stepper.run

        def recording_run(batches, lr):
            result = run(batches, lr)
            peaks.append(result.pipeline.peak_in_flight)
            return result

        trainer.stepper.run = recording_run
        records = trainer.train().records
        out.append({"records": records, "peaks": peaks, "pp_rank": ps.pp_rank,
                    "num_micro": trainer.num_micro})
    # the same 1F1B run as if each rank were a host of its own: the pipeline spans hosts
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    trainer = Trainer(parse_args(BASE + LAYOUT + ["--micro-batch-size", "2"]))
    out.append({"records": trainer.train().records})
    return out


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline_runs")
    results = run_distributed(train_with_files, grid=RankGrid(pp=PP, dp=DP),
                              args=(RUNS, str(folder)))
    return results, folder


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[r[0] for r in RUNS])
def test_metrics_carry_both_bubbles(pipeline_runs, index):
    results, folder = pipeline_runs
    schedule, mbs, vp = RUNS[index]
    m = 12 // (mbs * DP)
    theory = (PP - 1) / ((vp if schedule == "interleaved" else 1) * m + PP - 1)
    lines = (folder / f"{schedule}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for rank_result in results:   # every rank returns the same (grid-averaged) record values
        assert [r["bubble_measured"] for r in rank_result[index]["records"]] == \
               [r["bubble_measured"] for r in records]
    for r in records:
        assert r["bubble_theoretical"] == pytest.approx(theory, rel=1e-12), r
        # the replay with measured per-stage costs can only add imbalance to the equal-cost bubble
        assert theory - 1e-9 <= r["bubble_simulated"], r
        assert r["activations_in_flight"] == expected_in_flight(schedule, PP, m, vp, 0), r
        # the DP all-reduce hands over rank 0's gradient buffers, once (no ZeRO)
        assert r["dp_comm_bytes"] == r["grad_bytes"] > 0 and r["skipped"] is False
        # rates over the step's time: tokens of the whole step; FLOPs per device of all PP x DP
        # devices, over the dense peak
        dt, world = r["step_time_s"], PP * DP
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / dt, rel=1e-12), r
        assert r["model_tflops_per_device"] == pytest.approx(
            r["model_flops"] / dt / world / 1e12, rel=1e-12), r
        assert r["tflops_per_device"] == pytest.approx(
            r["executed_flops"] / dt / world / 1e12, rel=1e-12), r
        assert r["mfu"] == pytest.approx(r["model_tflops_per_device"] / PEAK, rel=1e-12), r
        assert r["hfu"] == pytest.approx(r["tflops_per_device"] / PEAK, rel=1e-12), r
    # the metric is the definition (parallel/pipeline/bubble.py) applied to the step's timeline:
    # per pipeline, measured_bubble of its ranks' executor events; the mean over all ranks
    trace = json.loads((folder / f"{schedule}.trace.json").read_text())["traceEvents"]
    last = [e for e in trace if e["ph"] == "X" and e["args"].get("step") == STEPS
            and e["cat"] in ("forward", "backward", "comm")]
    grid = RankGrid(pp=PP, dp=DP)
    per_rank = []
    for pipeline in grid.groups("pp"):
        events = [[{"cat": e["cat"], "start": e["ts"] / 1e6, "end": (e["ts"] + e["dur"]) / 1e6}
                   for e in last if e["tid"] == rank] for rank in pipeline]
        per_rank += measured_bubble(events).per_rank
    assert records[-1]["bubble_measured"] == pytest.approx(sum(per_rank) / len(per_rank), abs=1e-4)


def test_exposed_transfers_only_on_one_host(pipeline_runs):
    """time_pp_exposed_s compares a peer's post times with this rank's waits: computed when the
    pipeline's ranks share a host, null when they do not; the bubble (durations only) is there
    either way."""
    results, _ = pipeline_runs
    one_host, two_hosts = results[0][1]["records"], results[0][len(RUNS)]["records"]
    assert all(r["time_pp_exposed_s"] is not None for r in one_host)
    assert all(r["time_pp_exposed_s"] is None and r["bubble_measured"] is not None
               for r in two_hosts)


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[r[0] for r in RUNS])
def test_in_flight_micro_batches_follow_the_schedule(pipeline_runs, index):
    results, _ = pipeline_runs
    schedule, _, vp = RUNS[index]
    for rank_result in results:
        run = rank_result[index]
        want = expected_in_flight(schedule, PP, run["num_micro"], vp, run["pp_rank"])
        assert run["peaks"] == [want] * STEPS, (schedule, run["pp_rank"], run["peaks"], want)


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[r[0] for r in RUNS])
def test_timeline_has_one_track_per_rank(pipeline_runs, index):
    results, folder = pipeline_runs
    schedule, mbs, vp = RUNS[index]
    m = results[0][index]["num_micro"]
    trace = json.loads((folder / f"{schedule}.trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names) == list(range(PP * DP))
    for rank, label in names.items():
        assert label.startswith(f"rank {rank} ") and "pp" in label and "dp" in label, label
    spans = [e for e in events if e["ph"] == "X"]
    for rank in range(PP * DP):
        mine = sorted((e for e in spans if e["tid"] == rank), key=lambda e: e["ts"])
        compute = [e for e in mine if e["cat"] in ("forward", "backward")]
        # the trainer keeps the last TIMELINE_STEPS steps: m * vp forwards and backwards each
        kept = min(STEPS, TIMELINE_STEPS)
        assert sum(e["cat"] == "forward" for e in compute) == kept * m * vp
        assert sum(e["cat"] == "backward" for e in compute) == kept * m * vp
        assert sum(e["cat"] == "optimizer" for e in mine) == kept
        for cat in ("dp", "grad_sync", "clip"):  # the parts after the pipeline phase, once a step
            assert sum(e["cat"] == cat for e in mine) == kept, (rank, cat)
        for a, b in zip(compute, compute[1:]):     # one rank computes one thing at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (rank, a, b)


def test_interleaved_needs_micro_batches_multiple_of_pp(monkeypatch):
    """m = 12 / (4 * 1) = 3 is not a multiple of pp = 2: a ConfigError before any process group."""
    def no_collectives(*args, **kwargs):
        raise AssertionError("the process group was started before the layout was checked")

    monkeypatch.setattr(ParallelState, "initialize", no_collectives)
    cfg = parse_args(BASE + ["--pp", "2", "--pipeline-schedule", "interleaved",
                                  "--virtual-pipeline-size", "2", "--micro-batch-size", "4"])
    with pytest.raises(ConfigError, match=r"micro-batches per step \(3 = .*\) to be a multiple of --pp 2"):
        Trainer(cfg, launch=LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2))
    assert not dist.is_initialized()
