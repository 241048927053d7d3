"""The step's gradient work without per-parameter loops or host syncs.

- The multi-tensor ops (norm, clip/unscale multiply, overflow check + unscale, copies) equal the
  former per-parameter loops bit for bit, for fp32, fp16 and bf16 and for lists longer than one
  multi-tensor call takes.
- The optimizers hand those ops the few flat runs their gradients live in (one per buffer, or per
  bucket where buckets are padded), which
  cover every gradient element once; unscale, clip and the master/parameter copies through them
  equal the per-parameter versions bit for bit.
- A training step reads the device from the host exactly once (the step's statistics), serial and
  with pp=2 (under NCCL's backend rules), and the ops it issues after backward do not grow with
  the number of parameters.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from benchmarks.host.step_overhead import (after_backward_before, after_backward_now, as_before, build,
                                      count_launches, forward_backward)
from engine.config.cli import parse_args
from engine.training.lr_schedule import learning_rate
from engine.training.trainer import Trainer
from parallel.dp import DistributedOptimizer, GradReducer, MixedPrecisionOptimizer
from parallel.grads.norm import (FOREACH_MAX_TENSORS, check_and_unscale_,
                                 check_and_unscale_reference,
                                 counted_grads, local_norm_sq, local_norm_sq_reference, scale_,
                                 scale_reference)
from parallel.grads.main_grad import coalesce_views
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[3]
PROJECT = tuple(str(ROOT / d) for d in ("engine", "parallel", "models", "kernels"))


def tensors(n: int, dtype, seed: int, inf_at: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(1 + (i * 7) % 23, 3, generator=g) * 10 ** (i % 5 - 2)).to(dtype)
           for i in range(n)]
    if inf_at is not None:
        out[inf_at].view(-1)[0] = float("inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [5, FOREACH_MAX_TENSORS + 44])
def test_multi_tensor_ops_equal_per_tensor_loops_bit_for_bit(dtype, n):
    a, b = tensors(n, dtype, seed=n), tensors(n, dtype, seed=n)
    assert torch.equal(local_norm_sq(a), local_norm_sq_reference(b))
    scale_(a, 0.37), scale_reference(b, 0.37)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for inf_at in (None, n - 1):
        a, b = tensors(n, dtype, seed=n + 1, inf_at=inf_at), tensors(n, dtype, seed=n + 1, inf_at=inf_at)
        found, ref = check_and_unscale_(a, 1 / 1024), check_and_unscale_reference(b, 1 / 1024)
        assert torch.equal(found, ref) and found.item() == (0.0 if inf_at is None else 1.0)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    nan = tensors(3, dtype, seed=2)
    nan[1].view(-1)[-1] = float("nan")
    assert check_and_unscale_(nan, 1.0).item() == 1.0


def test_coalesce_views_merges_back_to_back_views_only():
    buf = torch.arange(12.0)
    views = [buf[6:9].view(3, 1), buf[0:3], buf[3:5], torch.ones(2)]
    runs = coalesce_views(views)     # (storages in address order, so compare as a set)
    assert sorted(r.tolist() for r in runs) == [[0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 1.0], [6.0, 7.0, 8.0]]
    next(r for r in runs if r.numel() == 5).mul_(2)
    assert buf[:5].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]        # views of the buffer, in place
    with pytest.raises(ValueError, match="overlapping"):
        coalesce_views([buf[0:4], buf[2:6]])


def _params(dtype=torch.bfloat16) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(1)
    shapes = [(16, 8), (8,), (8, 16), (16,), (32, 8), (8,), (5, 3)]
    named = []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        p.tp_sharded = i % 2 == 0
        named.append((f"p{i}", p))
    return named


def _fill_grads(reducer: GradReducer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in reducer.buffers:
        for slot in buf.slots:
            slot.param.main_grad.copy_(torch.randn(slot.param.shape, generator=g))
    reducer.finish()


@pytest.mark.parametrize("zero", [False, True])
def test_optimizer_helpers_run_on_flat_runs_and_equal_the_per_parameter_code(zero):
    ps = ParallelState.serial()
    named = _params()
    reducer = GradReducer(named, ps, bucket_size_mb=150 * 4 / 2 ** 20)   # a few small buckets
    opt = (DistributedOptimizer if zero else MixedPrecisionOptimizer)(named, reducer, ps, lr=1e-2)
    assert len(reducer.buckets) >= 3
    _fill_grads(reducer, seed=3)
    runs = opt.grad_tensors()
    pieces = opt.grad_pieces()
    # dp = 1: no padding between buckets, so one run per buffer (with dp > 1, one per bucket)
    assert len(runs) == len(reducer.buffers) < len(pieces)
    assert sum(r.numel() for r in runs) == sum(p.numel() for _, p in named)
    grads = [g for g, _ in pieces]
    before = [g.clone() for g in grads]
    opt.unscale_(1 / 64)
    scale_reference(before, 1 / 64)
    assert all(torch.equal(g, b) for g, b in zip(grads, before))
    found = opt.check_and_unscale_(0.5)
    check_and_unscale_reference(before, 0.5)
    assert found.item() == 0.0 and all(torch.equal(g, b) for g, b in zip(grads, before))
    opt.clip_(0.3)
    scale_reference(before, 0.3)
    assert all(torch.equal(g, b) for g, b in zip(grads, before))
    ref = local_norm_sq_reference(counted_grads(pieces, ps))
    torch.testing.assert_close(opt.grad_norm_sq(), ref, rtol=1e-6, atol=0)

    # the step's copies into the bf16 parameters: per parameter, as before
    opt.step(1e-2)
    if zero:
        expect = [opt.master[opt._piece_slice(piece)].to(torch.bfloat16) for piece in opt.pieces]
        got = [piece.param.detach().reshape(-1)[piece.start:piece.end] for piece in opt.pieces]
    else:
        expect = [m.detach().to(torch.bfloat16) for m in opt.masters]
        got = [p.detach() for p in opt.params]
    assert all(torch.equal(a, b) for a, b in zip(got, expect))


class HostReads(TorchFunctionMode):
    """Counts the reads of device values into the host that the project's own code issues."""
    NAMES = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PROJECT):
                self.where.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} "
                                  f"{func.__name__}")
        return func(*args, **(kwargs or {}))


TINY = ["--mock-data", "--vocab-size", "128", "--no-progress", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
        "--peak-tflops", "1"]


def _host_reads_per_step(argv: list[str]) -> list[list[str]]:
    trainer = Trainer(parse_args(TINY + argv))
    reads = []
    try:
        for step in range(3):
            batches, lr = trainer._batches(step), learning_rate(step, trainer.cfg.optim)
            with HostReads() as mode:
                out = trainer.stepper.run(batches, lr)
            reads.append(mode.where)
            assert out.grad_norm is not None and out.loss > 0
    finally:
        trainer.close()
    return reads


def _pp_host_reads(ps):
    # under NCCL's rules (the rest of the suite runs HCCL's): every collective legal there too
    return _host_reads_per_step(["--pp", "2", "--precision", "bf16", "--backend-rules", "nccl"])


def test_a_step_reads_the_device_once():
    for argv in (["--precision", "fp16"], ["--precision", "bf16", "--use-distributed-optimizer"]):
        for where in _host_reads_per_step(argv):
            assert len(where) == 1 and where[0].startswith("clock.py"), (argv, where)
    # with a pipeline too: the previous step's phase span (an int64 max over the stage's ranks,
    # for the measured bubble) is reduced on the device and joins this step's statistics
    for rank_reads in run_distributed(_pp_host_reads, grid=RankGrid(pp=2)):
        for where in rank_reads:
            assert len(where) == 1 and where[0].startswith("clock.py"), where


def test_ops_after_backward_do_not_grow_with_the_parameters():
    import argparse
    args = argparse.Namespace(vocab_size=64, hidden_size=16, heads=2, seq_length=8,
                              micro_batch_size=1, precision="fp16")
    counts = {}
    for layers in (2, 6):
        for name, fn, make in (("now", after_backward_now, build),
                               ("before", after_backward_before, lambda n, a: as_before(build(n, a)))):
            trainer = make(layers, args)
            for step in range(2):
                local_loss, pipe = forward_backward(trainer, step)
                fn(trainer, local_loss, pipe, 1e-4)
            counts[name, layers] = count_launches(trainer, fn, 2)
            trainer.close()
    assert counts["now", 2]["launches"] == counts["now", 6]["launches"] <= 20, counts
    assert counts["now", 6]["host_scalar_reads"] == 0
    assert counts["before", 6]["launches"] > counts["before", 2]["launches"] > 4 * counts["now", 2]["launches"]
