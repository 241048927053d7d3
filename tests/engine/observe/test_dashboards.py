"""Logging: the metrics JSONL (valid_loss, truncate on a fresh run, append on resume), TensorBoard
event files read back with tensorboard's own reader, and a W&B run in offline mode read back from its
.wandb file (wandb's protobuf records in LevelDB log framing)."""
import glob
import json
import struct
import time

import pytest

from engine.base import ConfigError
from engine.checkpoint.index import CheckpointError
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv

TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr-warmup-iters", "0", "--peak-tflops", "1"]


def train(argv):
    trainer = Trainer(parse_args(TINY + argv))
    try:
        return trainer.train()
    finally:
        trainer.close()


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_metrics_file_valid_loss_truncate_and_resume(tmp_path):
    metrics, save = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    result = train(["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                    "--metrics-file", metrics, "--save", save, "--save-interval", "2"])
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "valid_loss" in r] == [2, 4]
    assert [(r["step"], r["valid_loss"]) for r in rows if "valid_loss" in r] == result.valid
    # a run with nothing to do (--load of a checkpoint at --train-iters) is refused before its
    # first step: the outputs an earlier run wrote stay as they were
    timeline = tmp_path / "timeline.json"
    timeline.write_text("an earlier run's timeline")
    with pytest.raises(CheckpointError, match="is at step 4 and --train-iters is 4: nothing to"):
        train(["--train-iters", "4", "--metrics-file", metrics, "--timeline", str(timeline),
               "--load", f"{save}/iter_0000004"])
    assert read_jsonl(metrics) == rows and timeline.read_text() == "an earlier run's timeline"
    # a resumed run keeps steps 1..2 of the checkpoint it resumes and appends 3..6
    with open(metrics, "a") as fh:
        fh.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')  # a crashed attempt's leftovers
    train(["--train-iters", "6", "--metrics-file", metrics, "--load", f"{save}/iter_0000002",
           "--save", str(tmp_path / "ck2")])
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]
    assert read_jsonl(metrics)[:2] == rows[:2]
    # each process's first step is marked warm-up (--calibrate leaves it out): 1 and the resumed 3
    assert [r["warmup"] for r in read_jsonl(metrics)] == [True, False, True, False, False, False]
    train(["--train-iters", "2", "--metrics-file", metrics])  # a fresh run truncates
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2]


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = str(tmp_path / "tb")
    result = train(["--train-iters", "6", "--log-interval", "2", "--eval-interval", "3", "--eval-iters", "1",
                    "--tensorboard-dir", tb])
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "throughput/tokens_per_s",
            "throughput/mfu", "memory/peak_memory_bytes", "valid/loss"} <= tags
    assert not any(t.startswith("pipeline/") for t in tags)  # no PP: the bubble is null, not sent
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == [2, 4, 6]  # every --log-interval steps
    by_step = {r["step"]: r for r in result.records}
    assert all(loss[s] == pytest.approx(by_step[s]["loss"], rel=1e-6) for s in loss)
    lr = {e.step: e.value for e in acc.Scalars("train/lr")}
    assert all(lr[s] == pytest.approx(by_step[s]["lr"], rel=1e-6) for s in lr)
    valid = {e.step: e.value for e in acc.Scalars("valid/loss")}
    assert valid == pytest.approx(dict(result.valid), rel=1e-6) and sorted(valid) == [3, 6]


def test_a_fresh_run_replaces_the_tensorboard_events(tmp_path):
    """A fresh run into a --tensorboard-dir an earlier run wrote shows its own steps only, as its
    metrics file holds them (the earlier events are purged from step 1 on, by TensorBoard's reader)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "m.jsonl")
    for steps in ("3", "2"):
        result = train(["--train-iters", steps, "--log-interval", "1", "--tensorboard-dir", tb,
                        "--metrics-file", metrics])
    acc = EventAccumulator(tb)
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in result.records]


def wandb_records(path):
    """Yield wandb Record protobufs from a .wandb file: a 7-byte header, then LevelDB-log records
    (crc32 4 bytes, length 2, type 1, data) in 32 KiB blocks; types 1 full, 2 first, 3 middle, 4 last."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", raw[pos + 4: pos + 7])
        data = raw[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            yield rec


def test_wandb_offline_run(tmp_path):
    pytest.importorskip("wandb")
    save_dir = str(tmp_path / "wb")
    result = train(["--train-iters", "4", "--log-interval", "2", "--wandb-project", "gridtron-test",
                    "--wandb-mode", "offline", "--wandb-save-dir", save_dir, "--wandb-exp-name", "tiny"])
    files = glob.glob(f"{save_dir}/wandb/offline-run-*/run-*.wandb")
    assert len(files) == 1
    history = {}
    deadline = time.monotonic() + 60  # wandb's service process may still be writing the file
    while len(history) < 2 and time.monotonic() < deadline:
        for rec in wandb_records(files[0]):
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                history[items["_step"]] = items
        if len(history) < 2:
            time.sleep(1)
    by_step = {r["step"]: r for r in result.records}
    assert sorted(history) == [2, 4]
    for step, items in history.items():
        assert items["train/loss"] == pytest.approx(by_step[step]["loss"], rel=1e-6)


def test_missing_dashboard_packages_are_named_before_training(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="--wandb-project needs the wandb package: pip install wandb"):
        validate_run(parse_args(TINY + ["--wandb-project", "p"]), LaunchEnv(0, 1, 0, 1))


def test_summary_rates_are_totals_over_time():
    from engine.observe.metrics import summary_table
    base = dict(loss=1.0, skipped=False, bubble_theoretical=None, dp_comm_bytes=0, peak_memory_bytes=0)
    records = [dict(base, step=s, tokens=100, step_time_s=t, tokens_per_s=100 / t, tflops_per_device=2.0 / t,
                    mfu=0.2 / t) for s, t in ((1, 9.0), (2, 1.0), (3, 3.0))]  # step 1: warm-up, left out
    table = summary_table(records, {})
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()
            if line.startswith("| ")}
    assert rows["tokens/s (tokens / seconds)"] == "50"  # 200 tokens / 4 s, not the mean rate 66.7
    assert rows["TFLOP/s per device (executed / model)"].startswith("1.0000 /")   # 4 TFLOP / 4 s
    assert rows["MFU / HFU"].startswith("10.00% /")
    assert rows["timed steps"] == "2..3 (1 warm-up step left out)"
