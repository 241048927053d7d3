"""``time_tp_exposed_s``: the step's time blocked in tensor-parallel communication.

- The comm layer's watch (parallel/runtime/comm.py ``Activity.watched``): on a real 2-rank TP group
  every synchronous TP collective and every TP wait leaves one (start, end) pair of the watch
  clock's stamps around the call, in order; the ring of --tp-comm-overlap leaves one pair per posted
  transfer and one per wait; collectives of other groups (DP) and calls with nothing watched
  leave none.
- Through the real trainer (tp=2 with SP, plain and with --tp-comm-overlap): every step record
  carries a positive figure that is part of the step's forward/backward and gradient-sync time and
  is the sum of exactly the intervals the comm layer stamped from the step's start to its
  statistics (the forward/backward's among them); with tp=1 it is null.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.tensor_parallel.ring import ring_pass
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--precision", "fp32", "--peak-tflops", "1", "--train-iters", "3"]


class CountingClock:
    """Stamps 0, 1, 2, ...: a pair (a, a + 1) brackets exactly one call."""

    def __init__(self):
        self.ticks = itertools.count()

    def stamp(self) -> int:
        return next(self.ticks)


def watch_group(ps) -> dict:
    activity = ps.comm.activity
    tp, dp = ps.tp_group, ps.dp_group
    clock = CountingClock()
    activity.watch_clock = clock
    activity.watched = {"tp": []}
    pairs = activity.watched["tp"]
    x = torch.ones(4)
    tp.all_reduce(x)                                    # 1 pair
    out = torch.empty(2 * 4)
    tp.all_gather_into(out, x)                          # 1 pair
    work = tp.all_reduce(x.clone(), async_op=True)      # posting: 1 pair
    work.wait()                                         # its wait: 1 pair
    dp.all_reduce(torch.ones(3))                        # another group: none
    after_collectives = list(pairs)
    pairs.clear()
    shard = torch.full((1, 2, 3), float(ps.tp_rank))    # (b, s/tp, h)
    seen = []
    ring_pass(tp, shard, on_chunk=lambda c, chunk: seen.append((c, chunk.clone())))
    after_ring = list(pairs)
    activity.watched = {}
    tp.all_reduce(torch.ones(2))                        # nothing watched: none
    return {"collectives": after_collectives, "ring": after_ring, "seen": seen,
            "unwatched": clock.stamp()}


class Logged(list):
    """The step's list of watched TP intervals (the step empties it), each pair also kept in
    ``log``."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def append(self, pair) -> None:
        self.log.append(pair)
        super().append(pair)


def watch_steps(stepper) -> list[dict]:
    """Per step, the TP intervals the rank's comm layer stamped between the step's start and its
    statistics (after the gradient sync), and how many of them fell in the forward/backward."""
    log, steps = [], []
    stepper.tp_waits = stepper.ps.comm.activity.watched["tp"] = Logged(log)
    compute, forward_backward, statistics = (stepper.compute, stepper._forward_backward,
                                             stepper.statistics)

    def logged_compute(batches):
        steps.append({"start": len(log)})
        return compute(batches)

    def logged_forward_backward(*args, **kwargs):
        out = forward_backward(*args, **kwargs)
        steps[-1]["forward_backward"] = len(log) - steps[-1]["start"]
        return out

    def logged_statistics(*args, **kwargs):
        pairs = log[steps[-1]["start"]:]
        steps[-1]["pairs"] = len(pairs)
        steps[-1]["seconds"] = sum((stepper.clock.elapsed_s(a, b) for a, b in pairs), 0.0)
        return statistics(*args, **kwargs)

    stepper.compute, stepper._forward_backward = logged_compute, logged_forward_backward
    stepper.statistics = logged_statistics
    return steps


def train_records(argv: list[str]) -> dict:
    trainer = Trainer(parse_args(BASE + argv))
    steps = watch_steps(trainer.stepper) if trainer.ps.tp_size > 1 else []
    try:
        return {"records": trainer.train().records, "steps": steps}
    finally:
        trainer.close()


def trainer_group(ps) -> dict:
    sp = ["--tp", "2", "--dp", "1", "--sequence-parallel"]
    return {"plain": train_records(sp), "overlap": train_records(sp + ["--tp-comm-overlap"]),
            "tp1": train_records(["--tp", "1", "--dp", "2"])}


def test_watch_brackets_each_tp_call_and_nothing_else():
    results = run_distributed(watch_group, grid=RankGrid(tp=2, dp=2))
    for r in results:
        assert r["collectives"] == [(0, 1), (2, 3), (4, 5), (6, 7)], r["collectives"]
        # n = 2: one transfer posted (send + receive in one batch), its receive waited for, then
        # the send waited for at the end
        assert r["ring"] == [(8, 9), (10, 11), (12, 13)], r["ring"]
        assert r["unwatched"] == 14  # the unwatched all-reduce took no stamp
    for rank, r in enumerate(results):
        tp_rank = rank % 2
        own, other = r["seen"]
        assert own[0] == tp_rank and torch.all(own[1] == tp_rank)
        assert other[0] == 1 - tp_rank and torch.all(other[1] == 1 - tp_rank)


def test_step_records_carry_the_exposed_tp_time():
    results = run_distributed(trainer_group, world_size=2)
    for rank, result in enumerate(results):
        for name in ("plain", "overlap"):
            records, steps = result[name]["records"], result[name]["steps"]
            assert len(steps) == len(records) == 3, (name, rank, steps)
            for r, own in zip(records, steps):
                exposed = r["time_tp_exposed_s"]
                assert isinstance(exposed, float) and exposed > 0.0, (name, r["step"], exposed)
                assert exposed <= r["time_forward_backward_s"] + r["time_grad_sync_s"], (name, r)
                # exactly the step's own intervals: the forward/backward's (the layers'
                # collectives, the ring's waits) and the gradient sync's, none of an earlier step
                assert own["forward_backward"] > 0, (name, rank, own)
                assert own["pairs"] > own["forward_backward"], (name, rank, own)
                assert exposed == pytest.approx(own["seconds"], rel=1e-12), (name, rank, r, own)
        assert all(r["time_tp_exposed_s"] is None for r in result["tp1"]["records"])
