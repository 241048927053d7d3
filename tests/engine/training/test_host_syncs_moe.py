"""Host waits of MoE steps as a device sees them (the dispatch mode of engine/device/sync_ops.py,
a CPU run's default counter): at ep 1 an MoE step waits exactly as often as the dense step of the
same run shape (once, for its statistics), whatever the dispatcher and the capacity; at ep 2 each
MoE layer adds its one read of the split sizes per micro-batch (pinned copy on a side stream on a
device, parallel/expert_parallel/host_read.py) and nothing else, and with a padded capacity
nothing at all; the backward reads nothing (the split sizes are the forward's).

One spawned group of two ranks (dp 2: two micro-batches per rank and step) runs every case, three
steps each."""
from __future__ import annotations

import collections

import pytest

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS, MICRO, MOE_LAYERS = 3, 2, 2
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "8", "--micro-batch-size", "2",
        "--train-iters", str(STEPS), "--lr-warmup-iters", "0", "--log-interval", "100", "--host-sync-interval", "1",
        "--dp", "2", "--timeout-s", "60"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "1e-3"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
PADDED = CAPACITY + ["--moe-pad-expert-input-to-capacity"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
CASES = {  # name: (flags, the MoE layers' reads per micro-batch and layer)
    "dense": ([], 0),
    "ep1 alltoall": (MOE, 0), "ep1 allgather": (MOE + ALLGATHER, 0),
    "ep1 capacity": (MOE + CAPACITY, 0), "ep1 padded": (MOE + PADDED, 0),
    "ep1 llama": (MOE + ["--block", "llama", "--moe-router-load-balancing-type", "seq_aux_loss"], 0),
    "ep2 alltoall": (MOE + ["--ep", "2"], 1), "ep2 allgather": (MOE + ALLGATHER + ["--ep", "2"], 1),
    "ep2 capacity": (MOE + CAPACITY + ["--ep", "2"], 1), "ep2 padded": (MOE + PADDED + ["--ep", "2"], 0),
}


def _count(argv: list[str]) -> list[list[str]]:
    trainer = Trainer(parse_args(BASE + argv))
    assert trainer.clock.syncs.strict  # the CPU run's default: every op a device waits for
    try:
        return [r["host_sync_points"] for r in trainer.train().records]
    finally:
        trainer.close()


def _all(ps) -> dict:
    return {name: _count(flags) for name, (flags, _) in CASES.items()}


@pytest.fixture(scope="module")
def counted():
    return run_distributed(_all, grid=RankGrid(dp=2), timeout_s=120)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_step_waits_as_the_dense_step_plus_one_read_per_layer_under_ep(counted, name):
    reads = CASES[name][1]
    for rank in range(2):
        dense, points = counted[rank]["dense"], counted[rank][name]
        assert len(points) == STEPS
        for step, (mine, theirs) in enumerate(zip(points, dense), start=1):
            extra = collections.Counter(mine) - collections.Counter(theirs)
            assert collections.Counter(theirs) - collections.Counter(mine) == {}, (name, step, mine)
            # the split sizes' read of each MoE layer and micro-batch, a tolist and nothing else
            want = {"tensor.tolist": reads * MOE_LAYERS * MICRO} if reads else {}
            assert dict(extra) == want, (name, rank, step, mine)
    assert counted[0]["dense"][0] == ["statistics"]
