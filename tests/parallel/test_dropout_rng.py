"""Dropout under tensor parallelism: the model-parallel streams of parallel/random.py.

- seeds: collision-free over every (region, coordinate, chunk) of a grid, the worked example;
- the tracker: a region's stream continues across forks and leaves the default stream untouched;
- recomputation (selective and full) replays the same masks: losses and gradients equal the
  no-recompute run exactly, also when another micro-batch's forward runs in between (1F1B order);
- tp=2: the attention-probability masks of the two TP ranks differ (split region), the residual
  masks agree (replicated) and, with sequence parallelism, differ (each rank its own shard);
- a tp=2 run with dropout resumed from a checkpoint continues the uninterrupted run's losses exactly.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from parallel.random import (REGIONS, ModelParallelRNG, RNGTracker, StreamGrid, _mix64,
                             stream_index, stream_seed)
from parallel.topology import RankGrid
from tests.helpers.dist_utils import gather_tensors, run_distributed

TINY = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "2e-3", "--lr-warmup-iters", "0", "--dropout", "0.1", "--peak-tflops", "1"]


# ---- seeds and the tracker (pure) ------------------------------------------------------------

def test_stream_seeds_are_collision_free_and_follow_the_example():
    grid = StreamGrid(tp=2, pp=3, dp=2, vp=2, cp=2)
    seeds = {stream_seed(seed, region, grid, tp, pp, dp, chunk, cp)
             for seed in (0, 1, 7)
             for region, tp, pp, dp, chunk, cp in itertools.product(REGIONS, range(2), range(3),
                                                                     range(2), range(2), range(2))}
    assert len(seeds) == 3 * grid.streams
    example = StreamGrid(tp=2, pp=2)
    assert example.streams == 12 and stream_index("split", example, tp=1, pp=1) == 11
    assert stream_seed(5, "split", example, tp=1, pp=1) == _mix64(5 * 12 + 11)
    with pytest.raises(ValueError, match="outside"):
        stream_index("split", example, tp=2)
    with pytest.raises(ValueError, match="too large"):
        stream_seed(2 ** 63, "split", example)


def test_tracker_fork_continues_its_stream_and_spares_the_default():
    torch.manual_seed(3)
    want_default = torch.rand(4)
    tracker = RNGTracker({"replicated": 11, "split": 12})
    torch.manual_seed(3)
    with tracker.fork("split"):
        a = torch.rand(4)
    with tracker.fork("split"):
        b = torch.rand(4)
    assert torch.equal(torch.rand(4), want_default)  # the default stream did not move
    both = torch.rand(8, generator=torch.Generator().manual_seed(12))
    assert torch.equal(torch.cat([a, b]), both)  # one stream, continued across the two forks
    with tracker.fork("split"), pytest.raises(RuntimeError, match="inside itself"):
        with tracker.fork("split"):
            pass
    rng = ModelParallelRNG(1, StreamGrid(tp=2, vp=2), tp=1)
    assert len(rng.trackers) == 2 and rng.trackers[0].seeds != rng.trackers[1].seeds
    assert set(rng.state_tensors()) == {f"rng/tracker/{c}/{r}" for c in (0, 1)
                                        for r in ("replicated", "split")}


# ---- recomputation replays the masks ---------------------------------------------------------

def _chunk_grads(recompute: str, block: str):
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.state import ParallelState
    from parallel.tensor_parallel import Initializer
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=256, block=block, dropout=0.2)
    rng = ModelParallelRNG(7, StreamGrid())
    rng.seed_default()
    ctx = LayerContext(Initializer(1, 0.02), recompute=recompute, rng=rng.trackers[0])
    model = GPTChunk(cfg, ParallelState.serial(), ctx, range(2)).train()
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 256, (2, 2, 2, 32), generator=gen)  # (2 micro, b, s) each
    # 1F1B order: micro-batch 1's forward runs before micro-batch 0's backward (and recompute)
    loss0 = model(tokens[0], labels[0]).mean()
    loss1 = model(tokens[1], labels[1]).mean()
    loss1.backward()
    loss0.backward()
    return [loss0.item(), loss1.item()], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_recompute_replays_dropout_masks_exactly(block):
    ref_loss, ref_grads = _chunk_grads("none", block)
    for recompute in ("selective", "full"):
        loss, grads = _chunk_grads(recompute, block)
        assert loss == ref_loss, recompute
        for a, b in zip(grads, ref_grads):
            assert torch.equal(a, b), recompute


# ---- tp=2: split and replicated masks --------------------------------------------------------

def _masks_under_tp(ps, sequence_parallel: bool) -> dict:
    import kernels
    import models.layers as layers
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.tensor_parallel import Initializer
    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=256, dropout=0.5)
    rng = ModelParallelRNG.for_state(3, ps)
    rng.seed_default()
    ctx = LayerContext(Initializer(1, 0.02), sequence_parallel=sequence_parallel,
                       rng=rng.trackers[0])
    model = GPTChunk(cfg, ps, ctx, range(1)).train()
    seen = {"attention": [], "hidden": []}
    real = kernels.attention

    def attention(*args, **kwargs):  # the generator state the probabilities' mask is drawn from
        g = torch.Generator()
        g.set_state(torch.get_rng_state())
        seen["attention"].append(torch.rand(256, generator=g) < kwargs["dropout_p"])
        return real(*args, **kwargs)

    layers.kernels.attention = attention
    try:
        for module in model.modules():
            if isinstance(module, layers.Dropout):
                module.register_forward_hook(lambda m, i, o: seen["hidden"].append(o != 0))
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        model(tokens)
    finally:
        layers.kernels.attention = real
    out = {}
    for kind, masks in seen.items():
        flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.int32)
        both = gather_tensors(ps.tp_group, flat)
        out[kind] = bool(torch.equal(both[0], both[1]))
    return out


def tp_mask_checks(ps) -> dict:
    return {"plain": _masks_under_tp(ps, False), "sp": _masks_under_tp(ps, True)}


def test_tp_ranks_split_and_replicated_masks():
    results = run_distributed(tp_mask_checks, grid=RankGrid(tp=2))
    for rank_result in results:
        assert rank_result["plain"] == {"attention": False, "hidden": True}, rank_result
        assert rank_result["sp"] == {"attention": False, "hidden": False}, rank_result


# ---- tp=2 resume with dropout ----------------------------------------------------------------

def tp_resume(ps, folder: str) -> dict:
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    flags = TINY + ["--tp", "2", "--sequence-parallel", "--train-iters", "6"]
    full = Trainer(parse_args(flags + ["--save", f"{folder}/full", "--save-interval", "3",
                                       "--keep-last", "2"]))
    ref = [r["loss"] for r in full.train().records]
    resumed = Trainer(parse_args(flags + ["--load", f"{folder}/full/iter_0000003"]))
    return {"ref": ref, "resumed": [r["loss"] for r in resumed.train().records]}


def test_tp2_dropout_resume_continues_exactly(tmp_path):
    results = run_distributed(tp_resume, grid=RankGrid(tp=2), args=(str(tmp_path),))
    for r in results:
        assert len(r["ref"]) == 6 and r["resumed"] == r["ref"][3:], r
