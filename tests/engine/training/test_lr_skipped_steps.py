"""A skipped step (an fp16 overflow) does not advance the learning-rate schedule, as in Megatron-LM
and DeepSpeed: each step's LR is the schedule's at the number of updates applied before it, and a
run resumed from a checkpoint continues with the LRs of the uninterrupted run."""
import os

from engine.config.cli import parse_args
from engine.training.lr_schedule import learning_rate
from tests.helpers.training import train_records

# an initial loss scale this model's fp16 gradients overflow at (steps 1 and 3 skip), warm-up 4
ARGV = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--no-progress", "--train-iters", "8", "--precision", "fp16",
        "--lr", "1e-3", "--lr-warmup-iters", "4", "--device", "cpu", "--initial-loss-scale",
        "524288", "--hysteresis", "1"]


def records(extra: list[str]) -> list[dict]:
    return train_records(ARGV + extra)


def test_skipped_steps_hold_the_schedule_across_a_resume(tmp_path):
    whole = records([])
    skipped = [r["skipped"] for r in whole]
    assert any(skipped[:4]) and not all(skipped[:4]), skipped   # skips inside the warm-up
    optim = parse_args(ARGV).optim
    for i, r in enumerate(whole):
        assert r["lr"] == learning_rate(skipped[:i].count(False), optim), (i, skipped)
    assert whole[-1]["lr"] != learning_rate(7, optim)            # the iteration's LR differs
    records(["--save", str(tmp_path), "--save-interval", "4", "--train-iters", "4"])
    resumed = records(["--load", os.path.join(tmp_path, "iter_0000004")])
    assert [r["lr"] for r in resumed] == [r["lr"] for r in whole[4:]]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[4:]]
