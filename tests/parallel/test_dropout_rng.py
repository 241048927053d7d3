"""Dropout under tensor parallelism: the model-parallel streams of parallel/grid/random.py.

- seeds: collision-free over every (region, coordinate, chunk) of a grid, the worked example;
- the tracker: a region's stream continues across forks and leaves the default stream untouched;
- recomputation (selective and full) replays the same masks: losses and gradients equal the
  no-recompute run exactly, also when another micro-batch's forward runs in between (1F1B order);
- tp=2: the attention-probability masks of the two TP ranks differ (split region), the residual
  masks agree (replicated) and, with sequence parallelism, differ (each rank its own shard). The
  probabilities' mask is the one the kernel applied: read back from a second run of the kernel
  from the same generator state on values that make each kept probability visible, and checked
  to give the model's own attention output;
- a tp=2 run with dropout resumed from a checkpoint continues the uninterrupted run's losses exactly.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from parallel.grid.random import (REGIONS, ModelParallelRNG, RNGTracker, StreamGrid, _mix64,
                                  stream_index, stream_seed)
from parallel.grid.topology import RankGrid
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
    from parallel.grid.state import ParallelState
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

def probe_values(v: torch.Tensor) -> torch.Tensor:
    """Values (b, n, s, d) that make the probabilities' mask readable from the output: key j
    writes 2**(j // d) into channel j % d, so with all-equal scores channel c of row i is the sum
    of 2**r over the kept keys j = c + r d <= i, times 1 / ((i + 1)(1 - p))."""
    b, n, s, d = v.shape
    j = torch.arange(s)
    out = torch.zeros(s, d)
    out[j, j % d] = 2.0 ** (j // d)
    return out.expand(b, n, s, d).contiguous()


def applied_mask(real, q, k, v, dropout_p: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel ``real`` on (q, k, v) under the current generator state, and the dropout mask it
    applied to the probabilities, (b, n, s, s) bool (kept = True; above the causal diagonal
    False): the kernel runs again from the same state on q = k = 0 (all-equal scores) and
    ``probe_values``, which must draw exactly what the first call drew."""
    state = torch.get_rng_state()
    out = real(q, k, v, causal=True, dropout_p=dropout_p, **kwargs)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    probe = real(torch.zeros_like(q), torch.zeros_like(k), probe_values(v), causal=True,
                 dropout_p=dropout_p, **kwargs)
    assert torch.equal(torch.get_rng_state(), after), "the probe drew other random numbers"
    b, n, s, d = v.shape
    rows = torch.arange(1, s + 1, dtype=torch.float32).view(1, 1, s, 1)
    code = torch.round(probe.float() * rows * (1 - dropout_p)).to(torch.int64)  # (b, n, s, d)
    j = torch.arange(s)
    mask = ((code[..., j % d] >> (j // d)) & 1).bool()                           # (b, n, s, s)
    return out, mask & torch.ones(s, s, dtype=torch.bool).tril()


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

    def attention(q, k, v, causal=True, dropout_p=0.0, **kwargs):
        """The model's call, and the mask it applied: its output must be what that mask gives."""
        assert causal and dropout_p == cfg.dropout
        out, mask = applied_mask(real, q, k, v, dropout_p, **kwargs)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        probs = torch.softmax(scores.masked_fill(~torch.ones_like(mask).tril(), float("-inf")), -1)
        torch.testing.assert_close(out, (probs * mask / (1 - dropout_p)) @ v, rtol=1e-4, atol=1e-5)
        seen["attention"].append(mask)
        return out

    layers.kernels.attention = attention
    try:
        for module in model.modules():
            if isinstance(module, layers.Dropout):
                module.register_forward_hook(lambda m, i, o: seen["hidden"].append(o != 0))
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        model(tokens)
    finally:
        layers.kernels.attention = real
    (mask,) = seen["attention"]
    causal = torch.ones(32, 32, dtype=torch.bool).tril().expand_as(mask)
    out = {"attention_kept": float(mask[causal].float().mean())}
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
        for layout in ("plain", "sp"):   # p = 0.5 over 2 x 2 x 528 causal probabilities
            assert 0.4 < rank_result[layout].pop("attention_kept") < 0.6, rank_result
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
    out = {"ref": ref, "resumed": [r["loss"] for r in resumed.train().records]}
    # --no-load-rng: the dropout streams start from their seeds, as in a fresh run
    streams = {}
    for name, extra in (("fresh", []), ("no-load-rng", ["--load", f"{folder}/full/iter_0000003",
                                                        "--no-load-rng"]),
                        ("loaded", ["--load", f"{folder}/full/iter_0000003"])):
        trainer = Trainer(parse_args(flags + extra + ["--run-dir", f"{folder}/{name}"]))
        trainer.maybe_load()
        streams[name] = trainer.rng.state_tensors()
        trainer.close()
    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    out["no-load-rng fresh"] = same(streams["no-load-rng"], streams["fresh"])
    out["loaded fresh"] = same(streams["loaded"], streams["fresh"])
    return out


def test_tp2_dropout_resume_continues_exactly(tmp_path):
    results = run_distributed(tp_resume, grid=RankGrid(tp=2), args=(str(tmp_path),))
    for r in results:
        assert len(r["ref"]) == 6 and r["resumed"] == r["ref"][3:], r
        assert r["no-load-rng fresh"] and not r["loaded fresh"], r
