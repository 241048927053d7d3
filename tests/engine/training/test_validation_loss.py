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
