"""What a pp=1 step reports about its time: the timeline's forwards, backwards, DP reduction and
optimizer; the time_* keys; MFU against HFU under recomputation; the closing summary's warm-up;
--profile-steps through torch.profiler; --load X --save Y resuming from Y when it is newer."""
from __future__ import annotations

import glob
import json

import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.observe.metrics import summarize_run
from engine.config.schema import parse_steps
from engine.training.step import TIME_KEYS
from engine.training.trainer import Trainer

TINY = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "6",
        "--lr-warmup-iters", "0", "--peak-tflops", "1"]
PHASES = ["DP finish", "grad sync", "clip", "optimizer"]


def train(argv):
    trainer = Trainer(parse_args(TINY + argv))
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


def test_pp1_timeline_times_profile_and_summary(tmp_path):
    trace_path, prof = tmp_path / "t.json", tmp_path / "prof"
    _, result = train(["--train-iters", "3", "--timeline", str(trace_path), "--profile-steps", "2-2",
                       "--profile-dir", str(prof), "--recompute", "full"])
    records = result.records
    spans = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    for step in (1, 2, 3):
        mine = sorted((e for e in spans if e["args"]["step"] == step), key=lambda e: e["ts"])
        # 3 micro-batches: F0 B0 F1 B1 F2 B2, then the parts after the backward, in order
        assert [e["name"] for e in mine] == ["F0", "B0", "F1", "B1", "F2", "B2", *PHASES], mine
        assert [e["cat"] for e in mine[6:]] == ["dp", "grad_sync", "clip", "optimizer"]
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01, (a, b)  # one thing at a time (us, rounded)
        r = records[step - 1]
        compute = sum(e["dur"] for e in mine[:6]) / 1e6
        assert r["time_forward_backward_s"] >= compute - 1e-6
        assert r["step_time_s"] >= sum(r[k] for k in TIME_KEYS)
        assert r["time_optimizer_s"] == pytest.approx(mine[-1]["dur"] / 1e6, abs=2e-6)
    for r in records:  # full recomputation: executed / model FLOPs, the same for HFU / MFU
        assert r["hfu"] / r["mfu"] == pytest.approx(r["executed_flops"] / r["model_flops"], rel=1e-12)
        assert r["executed_flops"] > r["model_flops"]
        assert r["mfu"] == pytest.approx(r["model_tflops_per_device"], rel=1e-12)  # peak 1
        assert r["hfu"] == pytest.approx(r["tflops_per_device"], rel=1e-12)
    assert "timed steps" in result.summary and "2..3 (1 warm-up step left out)" in result.summary
    total = summarize_run(records, 1)
    assert total["tokens_per_s"] == pytest.approx(2 * 6 * 32 / (records[1]["step_time_s"] +
                                                                records[2]["step_time_s"]))
    traces = glob.glob(str(prof / "*.pt.trace.json"))
    assert len(traces) == 1, traces
    events = json.loads(open(traces[0]).read())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::mm" in names or "aten::addmm" in names
    assert "[memory]" in names  # profile_memory


def test_profile_steps_parse_and_reject():
    assert parse_steps("3-5") == (3, 5) and parse_steps("4") == (4, 4) and parse_steps(None) is None
    for bad in ("5-3", "0-2", "a-b"):
        with pytest.raises(ConfigError, match="--profile-steps"):
            parse_args(TINY + ["--profile-steps", bad])


def test_restart_resumes_from_save_when_newer_than_load(tmp_path):
    base, out = str(tmp_path / "base"), str(tmp_path / "out")
    train(["--train-iters", "2", "--save", base])
    _, first = train(["--train-iters", "4", "--load", base, "--save", out])
    assert [r["step"] for r in first.records] == [3, 4]
    # the job restarts with the same flags and a larger budget: it continues from out (step 4)
    _, again = train(["--train-iters", "5", "--load", base, "--save", out])
    assert [r["step"] for r in again.records] == [5]
