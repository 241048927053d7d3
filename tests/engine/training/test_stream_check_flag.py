"""``--stream-check``: the run under the stream-order checker; a violation ends it with exit code 1
and every violation on stderr, one per line (a race planted before training: a tensor written on a
side stream and read on the compute stream with no event between them)."""
from __future__ import annotations

import torch

from engine.training import launch
from engine.training.trainer import Trainer
from parallel.runtime import streams

ARGS = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--no-progress", "--device", "cpu"]


def test_a_violation_ends_the_run(monkeypatch, capsys):
    train = Trainer.train

    def racy(self):
        with streams.use(streams.side_stream("side", "cpu")):
            t = torch.ones(4)
            t.mul_(2)
        t.sum()                      # not ordered after the side stream's write
        return train(self)

    monkeypatch.setattr(Trainer, "train", racy)
    assert launch.main(ARGS + ["--stream-check"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "stream-order" in line or
           line.startswith("gridtron:   ")]
    assert len(err) == 2 and err[0] == "gridtron: stream-order check: 1 violation(s) on rank 0:"
    assert err[1].startswith("gridtron:   read after an unordered write: storage from ones at "
                             "tests/engine/training/test_stream_check_flag.py")
    assert "sum on stream 'compute' is not ordered after mul_ on stream 'side'" in err[1]
    assert err[1].endswith("the sum is issued at tests/engine/training/test_stream_check_flag.py:24 (racy)")
    assert launch.main(ARGS) == 0    # unchecked, the same run ends normally
