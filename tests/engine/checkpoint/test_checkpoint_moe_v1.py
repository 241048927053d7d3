"""Checkpoints written before the expert weights were stacked still load (tests/fixtures/
moe_ckpt_v1/, made by tests/fixtures/make_moe_ckpt_v1.py with one Parameter per expert and
projection): gpt2 blocks (GELU experts with biases, saved at dp 2 ep 1 under ZeRO-1) and llama
blocks (SwiGLU experts, the expert bias, saved at dp 2 ep 2 under ZeRO-1), both at step 2.

- every expert's logical tensor lands in its block of the stacked parameters, bit for bit (fc1,
  gate and up in the fused gate-up weight, fc2, the biases);
- resumed serially, steps 3 and 4 give the losses the old code gave resuming the same checkpoint
  serially, and resumed on the saved layout (2 gloo ranks: the optimizer state's flat ZeRO
  pieces read into the stacked parameters' shards) the losses of the uninterrupted old run, to a
  relative 1e-5 (the grouped GEMM and the combine sum in another order than the old loop).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from engine.checkpoint.reader import load_checkpoint
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from models.logical import logical_views
from parallel.grid.topology import RankGrid
from tests.fixtures.make_moe_ckpt_v1 import COMMON, HERE, MODELS, PARALLEL
from tests.helpers.dist_utils import run_distributed



def _ckpt(name: str) -> str:
    return os.path.join(HERE, name, "iter_0000002")


def _expected() -> dict:
    with open(os.path.join(HERE, "expected.json")) as fh:
        return json.load(fh)


def _close(got, want, rel=1e-5):
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= rel * abs(b), (got, want)


def _train(argv: list[str]) -> list[float]:
    trainer = Trainer(parse_args(COMMON + argv))
    try:
        return [r["loss"] for r in trainer.train().records]
    finally:
        trainer.close()


def _saved_layout(ps) -> dict:
    return {name: _train([*flags, *PARALLEL[name], "--load", _ckpt(name)])
            for name, flags in MODELS.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_old_expert_tensors_land_in_the_stacked_parameters(name):
    trainer = Trainer(parse_args(COMMON + MODELS[name] + ["--load", _ckpt(name)]))
    try:
        load_checkpoint(trainer, _ckpt(name))
        chunk = trainer.chunks[0]
        views = {}
        for i, layer in enumerate(chunk.layers):
            views.update({f"layers.{i}.mlp.experts.{n}": t
                          for n, t in logical_views(layer.mlp.experts).items()})
        with open(os.path.join(_ckpt(name), "index.json")) as fh:
            tensors = json.load(fh)["tensors"]
        expert_keys = [k for k in tensors if k.startswith("model/") and ".experts.experts." in k]
        parts = {"gpt2": ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"),
                 "llama": ("gate.weight", "up.weight", "fc2.weight")}[name]
        assert len(expert_keys) == 2 * 4 * len(parts)   # 2 layers, 4 experts
        for key in expert_keys:
            entry = tensors[key]
            assert len(entry["pieces"]) == 1
            with safe_open(os.path.join(_ckpt(name), entry["pieces"][0]["file"]), framework="pt") as fh:
                saved = fh.get_tensor(entry["pieces"][0]["key"])
            assert torch.equal(views[key[len("model/"):]].detach(), saved), key
        stacked = [n for n, _ in chunk.named_parameters() if ".experts." in n]
        assert all(n.rpartition(".")[2] in ("fc1_weight", "fc1_bias", "gate_up_weight", "fc2_weight",
                                            "fc2_bias") for n in stacked), stacked
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def on_saved_layout():
    return run_distributed(_saved_layout, grid=RankGrid(dp=2), timeout_s=120)


@pytest.mark.parametrize("name", list(MODELS))
def test_old_checkpoints_resume_with_the_old_losses(name, on_saved_layout):
    expected = _expected()[name]
    _close(_train([*MODELS[name], "--load", _ckpt(name)]), expected["serial_resumed"])
    for rank_result in on_saved_layout:
        _close(rank_result[name], expected["uninterrupted"])
