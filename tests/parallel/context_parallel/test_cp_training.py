"""Context parallelism in the trainer: gradients after one step, checkpoints across cp, bad input.

- Gradients: after one step's forward and backward (reducer finished), every parameter's gradient
  on a cp=2 rank equals the serial run's, for the ring and Ulysses, with and without packed
  documents and --eod-mask-loss (the loss scaling over DP x CP and the token count are right).
- Checkpoints: a run saved at cp=2 with ZeRO-1 sharded over CP resumes at cp=1 with the
  uninterrupted serial run's losses, and one saved at cp=1 resumes at cp=2; CP-replicated tensors
  are stored once. The validation losses at cp=2 are the serial run's.
- Bad layouts fail before any collective with what to change.

One spawned group of 2 ranks runs every multi-rank part (start-up costs seconds).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from engine.training.validate import validate_run
from parallel.grads.main_grad import current_grad, sync_sequence_parallel_grads
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

BASE = ["--mock-data", "--vocab-size", "24", "--no-progress", "--device", "cpu", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--global-batch-size", "8", "--micro-batch-size", "2", "--precision", "fp32", "--lr", "3e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "constant", "--peak-tflops", "1"]
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
GRAD_CASES = {"llama packed p2p": ["--block", "llama", "--num-query-groups", "2", *PACKED],
              "llama packed a2a": ["--block", "llama", "--num-query-groups", "2", *PACKED,
                                   "--cp-comm-type", "a2a"],
              "gpt2 p2p": ["--block", "gpt2"],
              "gpt2 packed a2a": ["--block", "gpt2", *PACKED, "--cp-comm-type", "a2a"]}
CKPT = ["--block", "llama", "--num-query-groups", "2", *PACKED, "--train-iters", "6",
        "--eval-interval", "3", "--eval-iters", "2"]


def one_step_grads(argv: list[str], launch: LaunchEnv | None = None) -> dict[str, torch.Tensor]:
    trainer = Trainer(parse_args(BASE + argv + ["--train-iters", "1"]), launch=launch)
    try:
        stepper = trainer.stepper
        trainer.optimizer.zero_grad()
        stepper._forward_backward(trainer._batches(0), 1.0)
        trainer.reducer.finish()
        sync_sequence_parallel_grads(stepper.params, trainer.ps)
        return {n: current_grad(p).detach().clone() for c in trainer.chunks
                for n, p in c.logical_named_parameters()}
    finally:
        trainer.close()


def _losses(argv: list[str], launch: LaunchEnv | None = None, valid: bool = False):
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    try:
        result = trainer.train()
        losses = [r["loss"] for r in result.records]
        return (losses, [v for _, v in result.valid]) if valid else losses
    finally:
        trainer.close()


def cp_runs(ps, root: str):
    grads = {name: one_step_grads(argv + ["--cp", "2"]) for name, argv in GRAD_CASES.items()}
    # from the serial step-3 checkpoint to step 6 at cp=2; a cp=2 ZeRO run saved at step 3
    resumed = _losses(CKPT + ["--cp", "2", "--load", os.path.join(root, "serial", "iter_0000003")],
                      valid=True)
    saved = _losses(CKPT + ["--cp", "2", "--use-distributed-optimizer", "--train-iters", "3",
                            "--save", os.path.join(root, "cp2")], valid=True)
    return grads, resumed, saved


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp"))
    serial = LaunchEnv()
    reference = _losses(CKPT, serial, valid=True)
    _losses(CKPT + ["--train-iters", "3", "--save", os.path.join(root, "serial")], serial)
    results = run_distributed(cp_runs, grid=RankGrid(cp=2), args=(root,), timeout_s=120)
    serial_grads = {name: one_step_grads(argv, serial) for name, argv in GRAD_CASES.items()}
    return root, reference, results, serial_grads


def close(got, want, rel=1e-4):
    assert len(got) == len(want) and got, (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rel * abs(w), (got, want)


def test_gradients_after_one_step_equal_serial(runs):
    _, _, results, serial = runs
    for rank, (grads, _, _) in enumerate(results):
        for case, want in serial.items():
            got = grads[case]
            assert got.keys() == want.keys()
            for name, g in got.items():
                w = want[name]
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-6 * w.abs().max()), \
                    f"rank {rank} {case} {name}: max error {(g - w).abs().max():.3g} of {w.abs().max():.3g}"


def test_checkpoints_across_cp(runs):
    root, (reference, ref_valid), results, _ = runs
    _, (resumed, resumed_valid), (saved, saved_valid) = results[0]
    close(resumed, reference[3:])                    # saved at cp=1, resumed at cp=2
    close(saved, reference[:3])
    close(saved_valid + resumed_valid, ref_valid)    # validation at steps 3 and 6, at cp=2
    close(_losses(CKPT + ["--load", os.path.join(root, "cp2", "iter_0000003")]), reference[3:])
    with open(os.path.join(root, "cp2", "iter_0000003", "index.json")) as fh:
        index = json.load(fh)
    assert index["layout"]["cp"] == 2
    for name, entry in index["tensors"].items():  # replicated over CP, stored once; ZeRO pieces tile
        stored = sum(p["flat"][1] - p["flat"][0] if "flat" in p else math.prod(p["shape"])
                     for p in entry["pieces"])
        assert stored == math.prod(entry["shape"]), name
    assert any("flat" in p for n, e in index["tensors"].items() if n.startswith("optim/")
               for p in e["pieces"])


@pytest.mark.parametrize("argv,match", [
    (["--cp", "2", "--seq-length", "34"], "not divisible by 2 x --cp = 4: ring attention"),
    (["--cp", "4", "--cp-comm-type", "a2a", "--seq-length", "34"], "not divisible by --cp 4"),
    (["--cp", "4", "--tp", "2", "--cp-comm-type", "a2a"], "--num-attention-heads / --tp = 4 / 2 = 2"),
    (["--cp", "2", "--dropout", "0.1"], r"applies no attention dropout, but --dropout \(which also "
                                         r"sets --attention-dropout\) is 0.1: use --attention-dropout 0"),
    (["--cp", "2", "--attention-dropout", "0.1"], "applies no attention dropout, but --attention-dropout is"),
    (["--cp", "2", "--compile"], "--compile with --cp > 1"),
    (["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-length", "12"],
     "--seq-length 12 / --cp 2 = 6 is not divisible by --tp 4"),
    (["--cp-comm-type", "ring"], "--cp-comm-type: invalid choice: .ring."),
])
def test_bad_cp_layouts(argv, match):
    with pytest.raises(ConfigError, match=match):
        cfg = parse_args(BASE + argv)
        world = cfg.parallel.cp * cfg.parallel.tp
        validate_run(cfg, LaunchEnv(0, world, 0, world))


def test_ring_attention_takes_residual_dropout():
    """Megatron's --hidden-dropout 0.1 --attention-dropout 0 under the ring: the residual branches'
    dropout runs outside attention, so only the attention probabilities' must be 0."""
    cfg = parse_args(BASE + ["--cp", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0"])
    assert (cfg.model.dropout, cfg.model.attention_dropout_p) == (0.1, 0.0)
    validate_run(cfg, LaunchEnv(0, 2, 0, 2))
