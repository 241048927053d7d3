"""Faults: a killed worker under torchrun restarts resumes by itself with the same losses, damaged
checkpoints are named down to the tensor (and an intact earlier one is offered), a NaN loss stops
the run naming the last good checkpoint, and a collective a peer never joins fails within
--timeout-s naming the group."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engine.checkpoint.index as cidx
from engine.checkpoint import CheckpointError
from engine.config.cli import parse_args
from engine.training.launch import describe_comm_failure
from engine.training.launch import main as train_main
from engine.training.trainer import Trainer, TrainingDiverged
from parallel.grid.topology import RankGrid
from engine.fuzz.pool import free_port
from tests.helpers.dist_utils import run_distributed

ROOT = str(Path(__file__).resolve().parents[3])
TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1"]


def losses(argv, cls=Trainer):
    trainer = cls(parse_args(TINY + argv))
    try:
        return [r["loss"] for r in trainer.train().records]
    finally:
        trainer.close()


def test_killed_worker_resumes_under_torchrun(tmp_path):
    args = TINY + ["--train-iters", "6", "--save", str(tmp_path / "ck"), "--save-interval", "2",
                   "--metrics-file", str(tmp_path / "m.jsonl")]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               GRIDTRON_TEST_CRASH=f"3:1:{tmp_path / 'crashed'}")  # rank 1 dies before step 4
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                           "-m", "tests.helpers.fault_worker", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "crashed").exists()
    assert "resuming from" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    # step 3 ran, was lost with the crash and ran again: the resumed run replaced its record
    assert steps == [1, 2, 3, 4, 5, 6], steps
    final = {r["step"]: r["loss"] for r in records}
    reference = losses(["--train-iters", "6"])  # uninterrupted, serial
    for step, want in enumerate(reference, 1):
        assert abs(final[step] - want) <= 1e-5 * abs(want), (step, final[step], want)


@pytest.fixture()
def three_checkpoints(tmp_path):
    root = str(tmp_path / "ck")
    losses(["--train-iters", "3", "--save", root, "--save-interval", "1", "--keep-last", "3"])
    return root


def _damage(ckpt_dir: str, tensor: str, how: str) -> str:
    index = cidx.read_index(ckpt_dir)
    fname, info = next(iter(index["files"].items()))
    path = os.path.join(ckpt_dir, fname)
    begin, end, _ = info["tensors"][tensor]
    with open(path, "r+b") as fh:
        if how == "flip":
            fh.seek((begin + end) // 2)
            byte = fh.read(1)
            fh.seek((begin + end) // 2)
            fh.write(bytes([byte[0] ^ 0xFF]))
        else:
            fh.truncate((begin + end) // 2)
    return fname


def test_damaged_checkpoints_are_named(three_checkpoints, capsys):
    root = three_checkpoints
    it = {s: os.path.join(root, f"iter_000000{s}") for s in (1, 2, 3)}
    fname = _damage(it[3], "model/layers.0.attn.qkv.weight", "flip")
    with pytest.raises(CheckpointError) as err:
        losses(["--train-iters", "4", "--load", root])
    msg = str(err.value)
    assert f"{fname} is corrupted" in msg and "'model/layers.0.attn.qkv.weight'" in msg
    assert f"the earlier checkpoint {it[2]} is intact: resume with --load {it[2]}" in msg
    # truncation of step 2: the error for the latest (3) now points at step 1
    _damage(it[2], "optim/exp_avg/layers.1.mlp.fc1.weight", "truncate")
    with pytest.raises(CheckpointError, match=r"is truncated \(\d+ of \d+ bytes\): tensors "
                                              r"'optim/exp_avg/layers.1.mlp.fc1.weight'"):
        losses(["--train-iters", "4", "--load", it[2]])
    assert train_main(TINY + ["--train-iters", "4", "--load", root]) == 2
    err_text = capsys.readouterr().err
    assert "checkpoint error" in err_text and f"--load {it[1]}" in err_text
    assert cidx.find_intact(root) == it[1]
    # inspect reports the damage and fails
    from engine.checkpoint import main as checkpoint_main
    assert checkpoint_main(["inspect", it[2]]) == 1
    assert "DAMAGED: rank_00000.safetensors is truncated" in capsys.readouterr().out
    # a damaged index and a dangling latest
    with open(os.path.join(it[3], "index.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(CheckpointError, match=f"index.json is damaged .*--load {it[1]}"):
        losses(["--train-iters", "4", "--load", it[3]])
    os.rename(it[3], it[3] + ".moved")
    with pytest.raises(CheckpointError, match=f"latest points at .* which does not exist.*--load {it[1]}"):
        losses(["--train-iters", "4", "--load", root])
    # the intact step 1 loads and trains on
    assert len(losses(["--train-iters", "2", "--load", it[1]])) == 1


class NaNAtStep4(Trainer):
    def train_one(self, step):
        if step == 3:
            with torch.no_grad():
                next(self.chunks[0].parameters()).fill_(float("nan"))
        return super().train_one(step)


def test_the_error_file_is_whole_or_absent(tmp_path, monkeypatch):
    """torchrun's agent reads a failed worker's error file, also one it stopped mid-write: half a
    JSON ended the agent itself with a JSONDecodeError (the job stopped, its restarts unused)."""
    import engine.training.launch as launch_mod
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped_half_way(obj, fh):
        fh.write('{"message": "gridtr')
        raise OSError("stopped")
    with monkeypatch.context() as m:
        m.setattr(launch_mod.json, "dump", stopped_half_way)
        launch_mod.write_error_file("a line")
    assert os.listdir(tmp_path) == []          # nothing for the agent to misread
    launch_mod.write_error_file("a line")
    assert json.loads(path.read_text())["message"] == "gridtron: a line"
    assert os.listdir(tmp_path) == ["error.json"]


def test_nan_loss_stops_with_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    root, metrics = str(tmp_path / "ck"), str(tmp_path / "metrics.jsonl")
    argv = ["--train-iters", "6", "--save", root, "--save-interval", "2"]
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 4; last good checkpoint: "
                                               rf".*{os.sep}iter_0000002"):
        losses(argv, cls=NaNAtStep4)
    # from the command line: exit 1, one line, torchrun's error file, the steps' records (the
    # last good one complete) and the failing step's, with its loss
    error_file = str(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
    monkeypatch.setattr("engine.training.trainer.Trainer", NaNAtStep4)
    capsys.readouterr()
    assert train_main(TINY + argv + ["--metrics-file", metrics, "--save", str(tmp_path / "ck2")]) == 1
    line = (f"gridtron: training diverged: loss is nan at step 4; last good checkpoint: "
            f"{tmp_path / 'ck2' / 'iter_0000002'}")
    assert capsys.readouterr().err.splitlines()[-1] == line
    with open(error_file) as fh:
        assert json.load(fh)["message"] == line
    assert os.listdir(tmp_path).count("error.json") == 1 and not any(
        n.endswith(".part") for n in os.listdir(tmp_path))
    with open(metrics) as fh:
        records = [json.loads(text) for text in fh]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["step_time_s"] is not None and math.isnan(records[3]["loss"])


def stall_one_rank(ps, argv):
    """Rank 1 never joins the step's collectives; rank 0 must fail within --timeout-s."""
    trainer = Trainer(parse_args(argv))
    if ps.rank == 1:
        time.sleep(8)
        return None
    start = time.perf_counter()
    try:
        trainer.train_one(0)
    except RuntimeError as exc:
        return describe_comm_failure(exc, trainer.ps, 3.0), time.perf_counter() - start
    return "no error", time.perf_counter() - start


def test_collective_timeout_names_group():
    message, waited = run_distributed(stall_one_rank, grid=RankGrid(dp=2),
                                      args=(TINY + ["--timeout-s", "3"],), timeout_s=60)[0]
    assert waited < 7, waited
    assert "over the dp group (ranks [0, 1])" in message and "timed out after 3 s" in message, message
    assert "GradReducer.finish" in message and "rank 0 (tp 0/1, pp 0/1, dp 0/2)" in message, message
