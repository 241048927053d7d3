"""The validation loss is the mean over every loss token of its ``--eval-iters`` global batches, as
the training loss is over one global batch's: with --eod-mask-loss, where batches hold different
numbers of unmasked tokens, two evaluation batches of B samples give the loss of one batch of
their 2B samples (the validation sampler's first 2B, in the same order)."""
import math

import pytest

from engine.config.cli import parse_args
from engine.training.run_data import validation_loss
from engine.training.trainer import Trainer
from tests.engine.data.test_loss_tokens import E, SEQ, corpus


def evaluated(prefix: str, batch: int, iters: int) -> tuple[float, list[int]]:
    trainer = Trainer(parse_args([
        "--data-path", prefix, "--split", "5,5,0", "--seq-length", str(SEQ), "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
        "--global-batch-size", str(batch), "--eval-iters", str(iters), "--eval-interval", "1",
        "--eod-mask-loss", "--precision", "fp32", "--device", "cpu", "--no-progress",
        "--train-iters", "1"]))
    try:
        sampler = trainer.data.sampler("valid", batch, trainer.cfg.seed)
        counts = [sum(int((trainer.data.valid[i][:-1] != E).sum()) for i in sampler.global_batch(it))
                  for it in range(iters)]
        return validation_loss(trainer), counts
    finally:
        trainer.close()


def test_evaluation_batches_pool_their_tokens(tmp_path):
    prefix = corpus(tmp_path / "docs", seed=0, num_docs=60)
    pooled, counts = evaluated(prefix, 4, 2)
    whole, (count,) = evaluated(prefix, 8, 1)
    assert counts[0] != counts[1] and sum(counts) == count   # unequal halves of the same samples
    assert math.isfinite(whole)
    assert pooled == pytest.approx(whole, rel=1e-6, abs=0)


# ---- evaluation leaves training alone --------------------------------------------------------

DROPPED = ["--mock-data", "--vocab-size", "24", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
           "--precision", "fp32", "--lr", "3e-3", "--lr-warmup-iters", "0", "--device", "cpu",
           "--no-progress", "--train-iters", "3", "--num-layers", "4", "--dropout", "0.1",
           "--attention-dropout", "0.1"]


def _losses(argv: list[str]) -> tuple[list[float], list[float]]:
    trainer = Trainer(parse_args(argv))
    try:
        result = trainer.train()
        return [r["loss"] for r in result.records], [v for _, v in result.valid]
    finally:
        trainer.close()


def with_and_without_evaluation(ps):
    """tp 2 and pp 2 with dropout, validating after every step or never."""
    out = {}
    for name, layout in (("tp2", ["--tp", "2"]), ("pp2", ["--pp", "2"])):
        out[name] = (_losses(DROPPED + layout + ["--eval-interval", "1", "--eval-iters", "1"]),
                     _losses(DROPPED + layout))
    return out


def test_evaluation_draws_no_dropout_mask_of_training():
    """An evaluation between steps switches dropout off, draws nothing from the dropout streams
    and restores training mode: with dropout 0.1, the training losses of a run that validates
    after every step are bit for bit those of a run that never does, under tp 2 (per-TP-rank
    streams) and pp 2 (the forward-only schedule)."""
    from parallel.grid.topology import RankGrid
    from tests.helpers.dist_utils import run_distributed
    results = run_distributed(with_and_without_evaluation, grid=RankGrid(dp=2), timeout_s=120)
    for rank, out in enumerate(results):
        for name, ((evaluated_losses, valid), (plain, none)) in out.items():
            assert len(valid) == 3 and none == [], (rank, name, valid, none)
            assert evaluated_losses == plain, (rank, name, evaluated_losses, plain)
