"""The built model's checks, agreed on every rank (engine/training/model_checks.py): a user's block
whose parameter copies would drift apart stops the run on every rank with one line naming the
parameter, at start-up (torch's own init, a hand-sliced TP shard) or after the second step (a
replicated parameter on the sequence shard without the ``sequence_parallel`` mark); a block that
builds no MoE layer under ``--num-experts`` is refused on every rank, also where only one pipeline
stage lacks it. The same blocks drawn and marked as docs/blocks.md says train on.

One spawned group of two ranks runs every case in turn.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.model_checks import TOLERANCE, fingerprints
from engine.training.trainer import Trainer
from models.blocks import TransformerBlock
from models.layers import Norm, ParallelAttention
from tests.helpers.dist_utils import run_distributed

HERE = "tests.engine.training.test_model_checks"
BASE = ["--mock-data", "--vocab-size", "64", "--no-progress", "--device", "cpu", "--precision",
        "fp32", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--train-iters", "2",
        "--lr-warmup-iters", "0", "--log-interval", "100"]


class TorchInit(TransformerBlock):
    """A gate drawn by torch's own init: different on every data-parallel rank."""

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__(cfg, layer_idx, ps, ctx)
        self.gate = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def _forward(self, x, inputs=None):
        x = x + self.attn(self.norm1(x), inputs)
        y = self.norm2(x)
        return x + self.mlp(y) * torch.sigmoid(self.gate(y))


class LayerScale(TransformerBlock):
    """A per-channel scale on the residual branches, drawn through the initializer; ``MARK``
    sets ``sequence_parallel`` as docs/blocks.md says."""
    MARK = False

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__(cfg, layer_idx, ps, ctx)
        h = cfg.hidden_size
        self.ls = nn.Parameter(ctx.init.full(f"layers.{layer_idx}.ls", (h,), std=0.5) + 1.0)
        if self.MARK:
            self.ls.sequence_parallel = ctx.sequence_parallel

    def _forward(self, x, inputs=None):
        x = x + self.ls * self.attn(self.norm1(x), inputs)
        return x + self.mlp(self.norm2(x))


class MarkedLayerScale(LayerScale):
    MARK = True


class HandSliced(TransformerBlock):
    """A (h,) scale whose TP rank keeps its own half, sliced by hand without the tp_sharded mark."""

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__(cfg, layer_idx, ps, ctx)
        h, t = cfg.hidden_size, ps.tp_size
        full = ctx.init.full(f"layers.{layer_idx}.scale", (h,), std=0.5) + 1.0
        self.scale = nn.Parameter(full.chunk(t)[ps.tp_rank].clone())

    def _forward(self, x, inputs=None):
        return x + self.attn(self.norm1(x), inputs) + self.mlp(self.norm2(x))


class NoExperts(nn.Module):
    """A plain block (attention only): no MoE layer anywhere."""
    position, final_norm, tie_embeddings = "learned", "layernorm", True

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__()
        self.norm = Norm("layernorm", cfg.hidden_size, cfg.norm_eps, ctx.sequence_parallel)
        self.attn = ParallelAttention(cfg, ps, ctx, f"layers.{layer_idx}.attn", bias=True,
                                      rope=False)

    def forward(self, x, inputs=None):
        return x + self.attn(self.norm(x), inputs)


def _outcome(argv) -> str:
    """"ok: <loss>" or the ConfigError's line."""
    try:
        trainer = Trainer(parse_args(BASE + argv))
    except ConfigError as exc:
        return f"refused: {exc}"
    try:
        result = trainer.train()
        return f"ok: {result.records[-1]['loss']:.6f}"
    except ConfigError as exc:
        return f"refused: {exc}"
    finally:
        trainer.close()


CASES = {
    "torch-init dp2": ["--dp", "2", "--block", f"{HERE}:TorchInit"],
    "torch-init dp2 zero3": ["--dp", "2", "--block", f"{HERE}:TorchInit",
                             "--use-distributed-optimizer", "--zero-stage", "3"],
    "layer-scale tp2 sp": ["--tp", "2", "--sequence-parallel", "--block", f"{HERE}:LayerScale"],
    "layer-scale tp2 sp zero3": ["--tp", "2", "--sequence-parallel", "--block",
                                 f"{HERE}:LayerScale", "--use-distributed-optimizer",
                                 "--zero-stage", "3"],
    "marked tp2 sp": ["--tp", "2", "--sequence-parallel", "--block", f"{HERE}:MarkedLayerScale"],
    "layer-scale tp2": ["--tp", "2", "--block", f"{HERE}:LayerScale"],
    "hand-sliced tp2": ["--tp", "2", "--block", f"{HERE}:HandSliced"],
    "no experts pp2": ["--pp", "2", "--block", f"{HERE}:NoExperts", "--num-experts", "2",
                       "--moe-router-topk", "1", "--moe-layer-freq", "[1,0]"],
    "gpt2 tp2 sp": ["--tp", "2", "--sequence-parallel"],
}


def _all(ps) -> dict:
    return {name: _outcome(argv) for name, argv in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, world_size=2, deadline_s=600.0)


def _same_on_every_rank(runs, name) -> str:
    lines = [r[name] for r in runs]
    assert lines[0] == lines[1], (name, lines)
    return lines[0]


@pytest.mark.parametrize("name", ["torch-init dp2", "torch-init dp2 zero3"])
def test_torch_init_is_refused_at_start_up(runs, name):
    line = _same_on_every_rank(runs, name)
    assert line.startswith("refused: rank 0: layers.0.gate.weight: its copies on the "
                           "data-parallel ranks differ at start-up; draw it through the "
                           "initializer"), line
    assert "(and on 1 more rank(s))" in line, line


@pytest.mark.parametrize("name", ["layer-scale tp2 sp", "layer-scale tp2 sp zero3"])
def test_unmarked_parameter_on_the_sequence_shard_is_refused_after_step_two(runs, name):
    line = _same_on_every_rank(runs, name)
    # (ZeRO-3 compares its shards' pieces, in bucket order: the last layer's first)
    assert re.match(r"refused: rank 0: layers\.[01]\.ls: its copies on the tensor-parallel ranks "
                    r"differ after step 2", line), line
    assert "sequence_parallel = True" in line, line


def test_a_hand_sliced_shard_is_refused_at_start_up(runs):
    line = _same_on_every_rank(runs, "hand-sliced tp2")
    assert line.startswith("refused: rank 0: layers.0.scale: its copies on the tensor-parallel "
                           "ranks differ at start-up"), line
    assert "tp_sharded" in line, line


def test_a_stage_without_its_moe_layer_stops_every_rank(runs):
    # only pipeline stage 0 (layer 0) should hold an MoE layer: rank 1 stops with rank 0's line
    line = _same_on_every_rank(runs, "no experts pp2")
    assert line.startswith("refused: rank 0: --num-experts 2: layer 0 of --block "
                           f"{HERE}:NoExperts builds no mixture of experts"), line


@pytest.mark.parametrize("name", ["marked tp2 sp", "layer-scale tp2", "gpt2 tp2 sp"])
def test_marked_and_engine_blocks_train(runs, name):
    assert _same_on_every_rank(runs, name).startswith("ok: "), runs[0][name]


def test_fingerprints_tell_a_different_draw_from_round_off():
    torch.manual_seed(0)
    a = torch.randn(64, 64)
    b = torch.randn(64, 64)
    close = a * (1 + 1e-7)  # round-off of a reduction done in another order
    fa, fb, fc = (fingerprints([t], "cpu")[0] for t in (a, b, close))
    scale_sq = fa[1].abs()
    assert (fa[1] - fb[1]).abs() > 100 * TOLERANCE * scale_sq  # a different draw: far out
    assert (fa[1] - fc[1]).abs() < 0.1 * TOLERANCE * scale_sq  # round-off: far in
    assert torch.equal(fingerprints([a], "cpu"), fingerprints([a.clone()], "cpu"))
