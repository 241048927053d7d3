"""1-bit Adam's state in checkpoints: the worker and server residuals, the synchronized momentum,
the frozen variance and the phase resume bit-identically on the same layout (fp32, and fp16
under ZeRO-2), a run resumed mid-warm-up keeps its warm-up, and under another layout the
residuals fold as summed logical tensors and the momentum comes back from its logical DP mean
(equal to exp_avg, which holds M)."""
import os

import torch

from engine.checkpoint import param_specs, read_index
from engine.checkpoint.tensor_reader import TensorReader
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.dp.residuals import logical_residual_pieces
from parallel.grid.topology import RankGrid
from tests.engine.checkpoint.test_checkpoint import TINY, losses
from tests.helpers.dist_utils import run_distributed

ONEBIT = ["--grad-compression", "onebit", "--grad-compression-warmup-steps", "1"]


def resumes(ps, root):
    out = {}
    for tag, extra in [("onebit", ONEBIT),
                       ("onebit-fp16-zero2", ONEBIT + ["--precision", "fp16", "--initial-loss-scale",
                                                       "4096", "--use-distributed-optimizer",
                                                       "--zero-stage", "2"]),
                       # warm-up 0.5 x 6 = 3 steps: the checkpoint at step 2 is inside it
                       ("mid-warmup", ["--grad-compression", "onebit",
                                       "--grad-compression-warmup-fraction", "0.5"])]:
        save = os.path.join(root, tag)
        iters = "6" if tag == "mid-warmup" else "4"
        full = losses(extra + ["--train-iters", iters, "--save", save, "--save-interval", "2",
                               "--keep-last", "3"])
        resumed = losses(extra + ["--train-iters", iters, "--load", os.path.join(save, "iter_0000002")])
        out[tag] = (full, resumed)
    # the phase is the checkpoint's: a longer run resumed from it keeps the 3-step warm-up
    path = os.path.join(root, "mid-warmup", "iter_0000002")
    trainer = Trainer(parse_args(TINY + ["--grad-compression", "onebit", "--train-iters", "10",
                                         "--grad-compression-warmup-fraction", "0.5", "--load", path]))
    trainer.maybe_load()
    out["warmup"] = trainer.reducer.policy.warmup_steps
    trainer.close()
    # ZeRO-2 -> no ZeRO: residuals folded from the summed logical tensors, M from its mean
    path = os.path.join(root, "onebit-fp16-zero2", "iter_0000002")
    trainer = Trainer(parse_args(TINY + ONEBIT + ["--precision", "fp16", "--initial-loss-scale", "4096",
                                                  "--train-iters", "4", "--load", path]))
    trainer.maybe_load()
    reader = TensorReader(path, read_index(path))
    specs = {sp.name: sp for sp in param_specs(trainer.chunks, ps, trainer.cfg.model.vocab_size)}
    for name, param, a, b, t in logical_residual_pieces(trainer.reducer, ps):
        saved = reader.read(f"optim/grad_residual/{name}", specs[name].offsets, list(param.shape),
                            flat=(a, b))
        torch.testing.assert_close(t, saved, rtol=1e-6, atol=1e-9)
    opt = trainer.optimizer
    index = {id(q): i for i, q in enumerate(opt.params)}
    for bucket in trainer.reducer.buckets:
        for slot in bucket.slots:
            m = opt.masters[index[id(slot.param)]]
            got = bucket.compressor.momentum[slot.start - bucket.start:slot.end - bucket.start]
            assert torch.equal(got, opt.inner.state[m]["exp_avg"].reshape(-1))
    trainer.close()
    return out


def test_onebit_resumes_exactly(tmp_path):
    results = run_distributed(resumes, grid=RankGrid(dp=2), args=(str(tmp_path),))[0]
    assert results.pop("warmup") == 3
    for tag, (full, resumed) in results.items():
        assert resumed == full[2:], tag
