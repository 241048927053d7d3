"""MFU and HFU: model vs executed FLOPs, the flop_counter fallback for blocks without a formula
(exact on the built-in blocks), null with a warning when a block cannot be measured, and the
dense peak per precision."""
from __future__ import annotations

import pytest
import torch

from engine.plan.flops import step_flops
from engine.observe.utilization import per_device, run_flops, run_peak_tflops, utilization
from models import GPT2Block, GPTConfig, LlamaBlock


class MyGPT2(GPT2Block):
    """A user's subclass: no formula is assumed for it, even though it computes what GPT2Block does."""


class MyLlama(LlamaBlock):
    pass


class Broken(torch.nn.Module):
    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__()

    def forward(self, x):
        raise RuntimeError("this block cannot run on meta tensors")


@pytest.mark.parametrize("block,cls", [("gpt2", MyGPT2), ("llama", MyLlama)])
def test_counted_flops_equal_the_formula_on_builtin_blocks(block, cls):
    cfg = GPTConfig(num_layers=3, hidden_size=128, num_attention_heads=4, seq_length=64,
                    vocab_size=512, block=block, num_query_groups=2)
    with pytest.warns(UserWarning, match="has no FLOPs formula: its FLOPs are counted"):
        counted = run_flops(cfg, cls, "none", global_batch=6)
    want = step_flops(6, 64, 3, 128, 512, cfg.ffn_hidden_size, block, "none",
                      kv_hidden=cfg.kv_hidden_size)
    assert counted.source == "flop_counter"
    assert counted.model == want.model and counted.executed == want.executed
    # the least a step runs: the attention core (4 s h per token and layer, 3 passes) at half,
    # the counted kernel's part as the formula's
    least = want.executed - 3 * 3 * 4 * 6 * 64 * 64 * 128 / 2
    assert counted.least == least and run_flops(cfg, GPT2Block if block == "gpt2" else LlamaBlock,
                                                "none", 6).least == least
    formula = run_flops(cfg, LlamaBlock if block == "llama" else GPT2Block, "full", 6)
    assert formula.source == f"formula {block}" and formula.executed > formula.model
    with pytest.warns(UserWarning, match="tflops_per_device and hfu are null"):
        recomputed = run_flops(cfg, cls, "full", 6)
    assert recomputed.model == want.model and recomputed.executed is None


def test_a_block_that_cannot_be_measured_has_null_flops():
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    with pytest.warns(UserWarning, match="tflops_per_device, mfu and hfu are null"):
        flops = run_flops(cfg, Broken, "none", 4)
    assert flops.model is None and flops.executed is None
    assert per_device(flops.model, 1.0, 8) is None and utilization(None, 312.0) is None
    assert utilization(per_device(3.12e14, 1.0, 1), 312.0) == pytest.approx(1.0)


def test_peaks_are_the_dense_ones_of_the_precision():
    class Dev:
        type, name = "cuda", "NVIDIA A100-SXM4-80GB"
    assert run_peak_tflops(Dev, "bf16", None) == 312.0
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert run_peak_tflops(Dev, "fp32", None) == 19.5
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        assert run_peak_tflops(Dev, "fp32", None) == 156.0
    finally:
        torch.set_float32_matmul_precision(old)
    assert run_peak_tflops(Dev, "bf16", 100.0) == 100.0

    class Npu:
        type, name = "npu", "Ascend910B2"
    assert run_peak_tflops(Npu, "fp32", None) is None  # no published figure: no MFU, not a guess


def test_a_block_whose_structure_depends_on_the_layer_is_counted_layer_by_layer():
    """``Hybrid`` has attention on even layers only. By the formulas' convention (2 FLOPs per
    multiply-add, the attention core in full, the logits over the unpadded vocabulary) a token
    costs 8h^2 (QKV and projection) + 4sh (the core) + 4hf (the MLP) in layer 0, 4hf in layer 1,
    and 2hV in the logits; a step is 3 forwards."""
    from tests.helpers.blocks import Hybrid
    h, s, f, V, B = 32, 32, 128, 64, 8
    cfg = GPTConfig(num_layers=2, hidden_size=h, num_attention_heads=4, seq_length=s,
                    vocab_size=V, ffn_hidden_size=f)
    per_token = (8 * h * h + 4 * s * h + 4 * h * f) + 4 * h * f + 2 * h * V
    with pytest.warns(UserWarning, match="one sequence per layer"):
        counted = run_flops(cfg, Hybrid, "none", B)
    assert counted.model == counted.executed == 3 * B * s * per_token == 37_748_736
    assert counted.least == counted.model - 3 * B * s * (4 * s * h) / 2  # layer 0's core at half


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_full_recompute_with_dropout_counts_the_last_matmul_again(block):
    # the block ends x + drop(down(...)): the dropout's mask makes the recompute run the down
    # projection too, 2 t h f more per layer than the early stop's count (t tokens)
    kw = dict(num_layers=3, hidden_size=128, num_attention_heads=4, seq_length=64,
              vocab_size=512, block=block)
    cls = LlamaBlock if block == "llama" else GPT2Block
    quiet = run_flops(GPTConfig(**kw), cls, "full", 6)
    dropped = run_flops(GPTConfig(**kw, dropout=0.1), cls, "full", 6)
    f = GPTConfig(**kw).ffn_hidden_size
    assert dropped.model == quiet.model
    assert dropped.executed - quiet.executed == 3 * 2 * 6 * 64 * 128 * f


def test_the_run_executes_its_padded_vocabulary_columns():
    """A vocabulary of 300 is allocated as 384 columns (a multiple of 128 at tp 1): the output
    layer's GEMMs run all of them, so the executed count (HFU) holds 3 x 2 x tokens x h x 84 more
    than the model count (MFU), which stays at the model's own 300."""
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    trainer = Trainer(parse_args(["--mock-data", "--vocab-size", "300", "--num-layers", "2",
                                  "--hidden-size", "64", "--num-attention-heads", "4",
                                  "--seq-length", "32", "--micro-batch-size", "2",
                                  "--global-batch-size", "4", "--train-iters", "1", "--no-progress"]))
    try:
        flops = trainer.flops
        assert tuple(trainer.chunks[0].embed.weight.shape) == (384, 64)  # (tied output layer)
        assert flops.executed - flops.model == 3 * 2 * (4 * 32) * 64 * (384 - 300)
        assert flops.model == step_flops(4, 32, 2, 64, 300, block="gpt2").model
    finally:
        trainer.close()
