"""What a run shows and writes: the progress bar (the latest loss; tokens/s and MFU computed as the
closing summary computes them), the console line without it, the summary's outputs and data, and
output files that a run failing at its first step leaves exactly as they were (sha256 before and
after, on 1 rank and on 2 gloo ranks)."""
import hashlib
import json
import os

import pytest

from engine.config.cli import parse_args
from engine.observe.anomaly import PersistentAnomaly
from engine.observe.faults import GradFault
from engine.observe.metrics import (REQUIRED_KEYS, SUMMARY_VALUE_WIDTH, MetricsLog, percent,
                                    summarize_run, summary_table)
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.summary import summary_cells

TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr-warmup-iters", "0", "--peak-tflops", "1", "--timeout-s", "60"]


def _records(n):
    """Step 1 is the slow warm-up (10 s, MFU 1%), the others 1-2 s with MFU 10-20%."""
    out = []
    for step in range(1, n + 1):
        r = dict.fromkeys(REQUIRED_KEYS, 0.0)
        dt = 10.0 if step == 1 else 1.0 + (step % 3) / 2
        mfu = 0.01 if step == 1 else 0.10 + 0.01 * (step % 10)
        r.update(step=step, loss=9.0 - 0.1 * step, lr=1e-3, tokens=1000, step_time_s=dt,
                 tokens_per_s=1000 / dt, mfu=mfu, skipped=False)
        out.append(r)
    return out


def _last_bar(err: str) -> str:
    return [part for part in err.replace("\r", "\n").split("\n") if "loss=" in part][-1]


def test_progress_bar_shows_the_latest_loss_and_the_summary_figures(capsys):
    records = _records(25)
    log = MetricsLog(None, progress=True, total_steps=25, log_interval=10)
    log.start_at(0)
    for r in records[:12]:
        log.log(r)
    # step 12, between two intervals: its own loss, not step 10's (nor step 1's)
    assert "loss=7.8000" in log._bar.postfix, log._bar.postfix
    assert f"mfu={percent(summarize_run(records[:12])['mfu'])}" in log._bar.postfix
    for r in records[12:]:
        log.log(r)
    log.close()
    bar = _last_bar(capsys.readouterr().err)
    s = summarize_run(records)
    assert "loss=6.5000" in bar, bar
    assert f"mfu={percent(s['mfu'])}" in bar and f"tok_s={s['tokens_per_s']:.0f}" in bar, bar
    # the summary table prints the very same MFU (steps 2..25, the warm-up left out)
    table = summary_table(records, {})
    assert f"| {percent(s['mfu'])} / " in table and percent(s["mfu"]) != percent(records[-1]["mfu"])
    assert percent(s["mfu"]) != percent(records[0]["mfu"])  # the warm-up step's 1.00%


def test_console_line_without_the_bar(capsys):
    records = _records(20)
    log = MetricsLog(None, progress=False, total_steps=20, log_interval=10)
    for r in records:
        log.log(r)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    for line, upto in zip(lines, (10, 20)):
        s = summarize_run(records[:upto])
        assert line == (f"step {upto}/20: loss {records[upto - 1]['loss']:.4f} | lr 0.001 | "
                        f"{s['tokens_per_s']:.0f} tokens/s, MFU {percent(s['mfu'])} (steps 2-{upto})")
    log = MetricsLog(None, progress=False, total_steps=3, log_interval=1)
    log.log(records[0])  # only the warm-up step so far: its own figures
    assert capsys.readouterr().err == "step 1/3: loss 8.9000 | lr 0.001 | 100 tokens/s, MFU 1.00% (steps 1-1)\n"


def test_peak_memory_is_the_largest_of_every_step_warm_up_included():
    records = _records(3)
    for r, peak in zip(records, (300, 200, 200)):
        r["peak_memory_bytes"] = peak
    assert summarize_run(records)["peak_memory_bytes"] == 300  # the warm-up step's peak


def test_summary_moe_figures_are_totals_and_null_when_a_step_has_none():
    """The imbalance: each step's figure (its most imbalanced layer's) weighted by its load, i.e.
    the hottest experts' loads summed over the steps over the mean loads summed; EP bytes null
    when a step has none (--compile)."""
    records = _records(3)
    for r, imbalance, ep in zip(records, (3.0, 1.5, 1.0), (10, 20, 40)):
        r.update(moe_expert_load=[20, 20], moe_load_imbalance=imbalance, moe_tokens_dropped=0,
                 ep_comm_bytes=ep)
    s = summarize_run(records)
    assert s["moe_load_imbalance"] == 1.25 and s["ep_comm_bytes"] == 30
    records[2]["ep_comm_bytes"] = None
    assert summarize_run(records)["ep_comm_bytes"] is None


def test_a_long_summary_value_wraps_at_spaces_and_reads_back_whole():
    """A value longer than the table's value width continues on lines of its own (an empty first
    cell), split at spaces; a path without spaces stays whole on one line."""
    words = " ".join(f"choice-{i} (what it does)" for i in range(12))
    path = "/" + "d" * 130
    table = summary_table(_records(3), {"choices": words, "data": path})
    lines = table.splitlines()
    key_width = lines[0].index("+", 1) - 3
    assert all(len(line) <= key_width + len(path) + 7 for line in lines)
    wrapped = [line for line in lines if line.startswith("| " + " " * key_width + " | ")]
    assert len(wrapped) >= 2 and all(len(line.split("|")[2].strip()) <= SUMMARY_VALUE_WIDTH
                                     for line in wrapped)
    cells = summary_cells(table)
    assert cells["choices"] == words and cells["data"] == path


def test_summary_names_its_outputs_and_data(tmp_path):
    from engine.training.trainer import Trainer
    run = tmp_path / "run"
    trainer = Trainer(parse_args(TINY + ["--train-iters", "2", "--run-dir", str(run)]))
    try:
        summary = trainer.train().summary
    finally:
        trainer.close()
    rows = summary_cells(summary)
    assert rows["metrics"] == str(run / "metrics.jsonl") and (run / "metrics.jsonl").is_file()
    assert rows["timeline"] == f"{run / 'timeline.json'} (the last 3 steps)"
    assert (run / "timeline.json").is_file()
    assert rows["data"] == "mock data, vocabulary 300"
    assert rows["plot"] == str(run / "loss.png")


# ---- a run that fails at its first step leaves the outputs there as they were --------------------
def _digests(root: str) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _earlier_run(root: str) -> None:
    """What an earlier run left: its metrics, timeline, plot and TensorBoard events."""
    os.makedirs(os.path.join(root, "tb"), exist_ok=True)
    with open(os.path.join(root, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2, 3))
    for name, data in (("timeline.json", b'{"traceEvents": []}'), ("loss.png", b"\x89PNG old"),
                       ("tb/events.out.tfevents.1.old", b"old events")):
        with open(os.path.join(root, name), "wb") as fh:
            fh.write(data)


def _outputs(root: str) -> list:
    return ["--metrics-file", os.path.join(root, "metrics.jsonl"), "--timeline",
            os.path.join(root, "timeline.json"), "--plot", os.path.join(root, "loss.png"),
            "--tensorboard-dir", os.path.join(root, "tb")]


def fail_at_step_one(ps, root):
    """A NaN in rank 0's gradient at step 1 on every execution: a persistent bad step stops the
    run on every rank before its first record."""
    from engine.training.trainer import Trainer
    if ps is None or ps.rank == 0:
        _earlier_run(root)
    if ps is not None:
        ps.world_group.barrier()
    before = _digests(root)
    trainer = Trainer(parse_args(TINY + ["--train-iters", "3", "--rerun-on-anomaly"] + _outputs(root)))
    GradFault(rank=0, step=1, param="layers.0.mlp.fc2.weight", repeat=True).install(trainer)
    try:
        trainer.train()
        failed = "no error"
    except PersistentAnomaly as exc:
        failed = str(exc)
    finally:
        trainer.close()
    after = _digests(root)
    # then a run that starts: the metrics file is replaced whole, nothing is left beside it
    trainer = Trainer(parse_args(TINY + ["--train-iters", "2"] + _outputs(root)))
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(os.path.join(root, "metrics.jsonl")) as fh:
        steps = [json.loads(line)["step"] for line in fh]
    return {"failed": failed, "before": before, "after": after, "steps": steps,
            "files": sorted(os.listdir(root))}


def _check(res):
    assert "step 1: non-finite gradient norm" in res["failed"] and "persistent" in res["failed"]
    assert res["before"] == res["after"] and len(res["before"]) == 4, res
    assert res["steps"] == [1, 2]
    assert res["files"] == ["loss.png", "metrics.jsonl", "tb", "timeline.json"]  # no temporary left


def test_a_failed_start_leaves_the_outputs_on_one_rank(tmp_path):
    pytest.importorskip("tensorboard")
    _check(fail_at_step_one(None, str(tmp_path)))


def test_a_failed_start_leaves_the_outputs_on_two_ranks(tmp_path):
    pytest.importorskip("tensorboard")
    res = run_distributed(fail_at_step_one, grid=RankGrid(dp=2), args=(str(tmp_path),), timeout_s=120)
    for rank in (0, 1):
        _check(res[rank])
