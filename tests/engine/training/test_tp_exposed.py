"""``time_tp_exposed_s``: the step's time blocked in tensor-parallel communication.

- The comm layer's watch (parallel/runtime/comm.py ``Activity.watched``): on a real 2-rank TP group
  every synchronous TP collective and every TP wait leaves one (start, end) pair of the watch
  clock's stamps around the call, in order; the ring of --tp-comm-overlap leaves one pair per posted
  transfer and one per wait; collectives of other groups (DP) and calls with nothing watched
  leave none.
- Through the real trainer (tp=2 with SP, plain and with --tp-comm-overlap): every step record
  carries a positive figure that is part of the step's forward/backward and gradient-sync time;
  with tp=1 it is null.
"""
from __future__ import annotations

import itertools

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


def train_records(argv: list[str]) -> list[dict]:
    trainer = Trainer(parse_args(BASE + argv))
    try:
        return trainer.train().records
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
    records = results[0]
    for name in ("plain", "overlap"):
        for r in records[name]:
            exposed = r["time_tp_exposed_s"]
            assert isinstance(exposed, float) and exposed > 0.0, (name, r["step"], exposed)
            assert exposed <= r["time_forward_backward_s"] + r["time_grad_sync_s"], (name, r)
    assert all(r["time_tp_exposed_s"] is None for r in records["tp1"])
