"""AdamW's weight decay reaches the matrices only: not biases (the MoE experts' biases, stacked
(experts, width) per layer, among them), norms or position tables, as Megatron-LM does. Seen in
what the trainer does: from the same weights (a checkpoint of one step: the biases start at zero,
where decay shows nothing), one step with --weight-decay 0.5 against the same step without leaves
every excluded parameter bit-equal and moves every matrix, with either optimizer."""
import pytest
import torch

from engine.config.cli import parse_args
from engine.training.trainer import Trainer

ARGV = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--no-progress", "--train-iters", "1", "--precision", "fp32",
        "--lr", "0.1", "--lr-warmup-iters", "0", "--device", "cpu", "--num-experts", "4",
        "--moe-layer-freq", "[0,1]", "--block", "gpt2"]


def one_step(extra: list[str]) -> dict[str, torch.Tensor]:
    trainer = Trainer(parse_args(ARGV + extra))
    try:
        trainer.train()
        return {n: p.detach().clone() for c in trainer.chunks for n, p in c.logical_named_parameters()}
    finally:
        trainer.close()


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["mixed", "zero1"])
def test_decay_on_matrices_only(optimizer, tmp_path):
    one_step(optimizer + ["--save", str(tmp_path)])
    start = optimizer + ["--load", str(tmp_path), "--finetune"]
    plain, decayed = one_step(start + ["--weight-decay", "0"]), one_step(start + ["--weight-decay", "0.5"])
    kept = [n for n in plain if n.endswith("bias") or "norm" in n or "position" in n]
    assert {"layers.1.mlp.experts.fc1_bias", "layers.1.mlp.experts.fc2_bias",
            "layers.0.mlp.fc1.bias", "embedding.position"} <= set(kept), sorted(plain)
    for name in kept:
        assert torch.equal(plain[name], decayed[name]), f"{name} was decayed"
    moved = [n for n in plain if n not in kept]
    assert "layers.1.mlp.experts.fc1_weight" in moved and "layers.0.attn.qkv.weight" in moved
    for name in moved:
        assert not torch.equal(plain[name], decayed[name]), f"{name} was not decayed"
