"""Single-process training through the real command line: the built-in corpus, metrics, the block
registry and user blocks.

The serial run's FLOPs figures are the FLOPs torch.utils.flop_counter counts on a forward and
backward of the run's own model over one global batch (the attention core on its plain-math
reference, whose two matrix products the counter sees), its TFLOP/s that over the step's time,
and its exposed communication what a serial run has: no DP collective in flight (0.0), no
pipeline, ZeRO gather or TP group (null)."""
import json

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.observe.metrics import REQUIRED_KEYS
from engine.training.trainer import Trainer
from engine.training.validate import validate_run
from models import GPT2Block, GPTConfig
from models.registry import BlockRegistry
from parallel.grid.launch import LaunchEnv

TINY = ["--tokenizer", "bpe:2048", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--no-progress"]


def run(argv, registry=None):
    trainer = Trainer(parse_args(argv), registry=registry)
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


def counted_step_flops(trainer, monkeypatch) -> float:
    """FLOPs of one forward and backward of the trainer's model over one global batch."""
    import kernels
    from engine.plan.flops import count_flops
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, causal=True, dropout_p=0.0, **_:
                        kernels.attention_reference(q, k, v, causal, dropout_p))
    cfg = trainer.cfg
    tokens = torch.randint(0, trainer.data.vocab_size,
                           (cfg.data.global_batch_size, cfg.model.seq_length + 1))
    trainer.optimizer.zero_grad()
    _, flops = count_flops(lambda: trainer.chunks[0](tokens[:, :-1], tokens[:, 1:]).mean().backward())
    return flops


def test_builtin_corpus_lowers_validation_loss(tmp_path, corpus_cache, monkeypatch):
    metrics = tmp_path / "m.jsonl"
    plot = tmp_path / "loss.png"
    trainer, result = run(TINY + [
        "--cache-dir", corpus_cache, "--train-iters", "30", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-warmup-iters", "4", "--eval-interval", "10", "--eval-iters", "2",
        "--metrics-file", str(metrics), "--plot", str(plot)])
    assert trainer.data.tokenizer is not None and 256 < trainer.data.vocab_size <= 2048
    flops = counted_step_flops(trainer, monkeypatch)
    valid = [v for _, v in result.valid]
    assert len(valid) == 3 and valid[-1] < valid[0] - 0.2, valid
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["tokens"] == 8 * 64 and r["skipped"] is False and r["loss_scale"] == 1.0
        assert r["bubble_theoretical"] is None and r["bubble_measured"] is None
        assert r["dp_comm_bytes"] == 0 and r["grad_norm"] > 0 and r["peak_memory_bytes"] > 0
        assert r["model_flops"] == r["executed_flops"] == flops, (r["executed_flops"], flops)
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-12)
        assert r["tflops_per_device"] == pytest.approx(flops / r["step_time_s"] / 1e12, rel=1e-12)
        # the CPU "peak" is one matmul measurement: MFU is the achieved rate over exactly that figure
        assert trainer.peak_tflops > 0
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / trainer.peak_tflops, rel=1e-12)
        assert r["time_dp_exposed_s"] == 0.0 and r["time_pp_exposed_s"] is None
        assert r["time_zero_gather_exposed_s"] is None and r["time_tp_exposed_s"] is None
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert plot.exists() and plot.stat().st_size > 1000
    assert "first / last loss" in result.summary and "validation loss" in result.summary


def test_moe_flops_are_the_counted_ones(monkeypatch):
    """An MoE layer's FLOPs are its router and the top-k experts each token runs through (dropless:
    every token reaches K experts), not the dense MLP's: the record's model FLOPs are what the
    counter sees in a forward and backward of the run's model (a dense layer and an MoE one)."""
    trainer, result = run(TINY + ["--mock-data", "--vocab-size", "256", "--train-iters", "2",
                                  "--num-experts", "4", "--moe-router-topk", "2",
                                  "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "32",
                                  "--peak-tflops", "1"])
    assert [trainer.cfg.model.is_moe_layer(i) for i in range(2)] == [False, True]
    flops = counted_step_flops(trainer, monkeypatch)
    for r in result.records:
        assert r["model_flops"] == r["executed_flops"] == flops, (r["model_flops"], flops)
        assert r["mfu"] == pytest.approx(flops / r["step_time_s"] / 1e12, rel=1e-12)


def test_custom_block_trains(corpus_cache):
    _, result = run(TINY + ["--cache-dir", corpus_cache, "--train-iters", "15", "--lr", "3e-3", "--lr-warmup-iters", "2",
                            "--block", "examples.parallel_block:ParallelResidualBlock"])
    losses = [r["loss"] for r in result.records]
    assert losses[-1] < losses[0] - 0.5, losses


class DoubleNormBlock(GPT2Block):
    """A registered block with a different norm placement, used through its registered name."""
    norm_kind = "rmsnorm"


def test_registered_block_name():
    registry = BlockRegistry()
    registry.register("double-norm", DoubleNormBlock)
    trainer, result = run(TINY + ["--mock-data", "--vocab-size", "64", "--train-iters", "2",
                                  "--block", "double-norm"], registry=registry)
    assert isinstance(trainer.chunks[0].layers[0], DoubleNormBlock)
    assert len(result.records) == 2


class WrongSignature(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()


@pytest.mark.parametrize("spec,match", [
    ("no_such_module:Block", "cannot import module 'no_such_module'"),
    ("examples.parallel_block:Missing", "has no class 'Missing'"),
    ("collections:OrderedDict", "is not an nn.Module subclass"),
    ("tests.engine.training.test_trainer:WrongSignature", "must take \\(cfg, layer_idx, ps, ctx\\)"),
    ("nonsense", "unknown --block 'nonsense'; use one of gpt2, llama"),
])
def test_block_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        validate_run(parse_args(["--block", spec]), LaunchEnv())


def test_llama_defaults():
    cfg = GPTConfig(hidden_size=96, num_attention_heads=4, block="llama")
    assert cfg.ffn_hidden_size == 256  # 8h/3 rounded up to 64
