"""FP8 mixture-of-experts training through the trainer: the experts' grouped GEMMs run in FP8
(kernels/fp8_grouped.py; on this CPU one ``torch._scaled_mm`` per expert, counted), and the
layouts train the serial FP8 run's model.

A two-layer GPT whose layers are both MoE (4 experts, top-2, expert width 32: a multiple of 16, so
every expert GEMM is a real FP8 GEMM), --fp8-format hybrid:

- a spy on ``aten._scaled_mm`` (a dispatch mode that observes) sees the experts' GEMMs, told apart
  by the expert width 32 (no attention GEMM has a dimension of 32 here); FP8 moves the losses from
  the bf16 run's, within the bound docs/precision.md states for FP8 (2e-3 relative per step);
- layouts (one spawned group of 4 gloo ranks) against the serial FP8 run, every step of 20 within
  ``FP8_LAYOUT_TOLERANCE`` (docs/precision.md): ep 2 with expert tensor parallelism (the per-token
  amaxes of fc2's input and the weights' amaxes reduced over ETP), ep 2 with sequence parallelism
  and etp 1 (the weight gradients' column amaxes reduced over TP; each EP source its own row
  segment), ep 2 under zb-h1 with pp 2 (the experts' deferred weight gradients in FP8), ep 2
  under cp 4 (each micro-batch's four CP slices reach two EP groups: the weight gradients' column
  amaxes per (expert, micro-batch), merged on the rank and over EDP).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.engine.training.test_fp8_train import FP8_LAYOUT_TOLERANCE
from tests.helpers.corpus import real_text_corpus
from tests.helpers.dist_utils import run_distributed

STEPS = 20
EXPERT_WIDTH = 32
FP8 = ["--fp8-format", "hybrid"]
LAYOUTS = {
    "tp2 dp2 ep2 etp2": ["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "2"],
    "tp2 dp2 ep2 sp": ["--tp", "2", "--dp", "2", "--ep", "2", "--sequence-parallel"],
    "pp2 dp2 ep2 zb-h1": ["--pp", "2", "--dp", "2", "--ep", "2", "--pipeline-schedule", "zb-h1"],
    "cp4 ep2": ["--cp", "4", "--ep", "2"],
}


def base(data: str, steps: int = STEPS) -> list[str]:
    return ["--data-path", data, "--no-progress", "--device", "cpu", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", str(steps),
            "--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--peak-tflops", "1",
            "--bf16", "--log-interval", "100", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", str(EXPERT_WIDTH), "--moe-aux-loss-coeff", "0.01"]


class ExpertGemms(TorchDispatchMode):
    """Counts ``aten._scaled_mm`` calls, and those with the expert width among their dimensions
    (the experts': fc1 (n, h) x (h, f), fc2 and the gradients), split into the forward's and the
    backward's (input and weight gradients: called while autograd runs a graph node); observes
    only."""

    def __init__(self):
        super().__init__()
        self.all = self.experts = 0
        self.passes = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            a, b = args[0], args[1]
            self.all += 1
            if EXPERT_WIDTH in (a.shape[0], a.shape[1], b.shape[1]):
                self.experts += 1
                backward = torch._C._current_autograd_node() is not None
                self.passes["backward" if backward else "forward"] += 1
        return func(*args, **(kwargs or {}))


def serial(argv: list[str], spy: TorchDispatchMode | None = None) -> list[float]:
    trainer = Trainer(parse_args(argv), launch=LaunchEnv())
    if spy is None:
        return [r["loss"] for r in trainer.train().records]
    with spy:
        return [r["loss"] for r in trainer.train().records]


def train_all(ps, jobs: list[list[str]]) -> list[list[float]]:
    return [[r["loss"] for r in Trainer(parse_args(argv)).train().records] for argv in jobs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = real_text_corpus(tmp_path_factory, "fp8_moe_corpus")
    spy = ExpertGemms()
    out = {"spy": spy, "fp8 spied": serial(base(data, 1) + FP8, spy)}
    out["fp8"] = serial(base(data) + FP8)
    out["bf16"] = serial(base(data, 8))
    jobs = [base(data) + FP8 + flags for flags in LAYOUTS.values()]
    out["layouts"] = dict(zip(LAYOUTS, run_distributed(train_all, grid=RankGrid(dp=4),
                                                       args=(jobs,))[0]))
    return out


def test_the_expert_gemms_run_in_fp8(runs):
    """One step: 2 MoE layers x 4 micro-batches x 2 projections x one GEMM per expert with rows
    in the forward, and as many for each of the input and the weight gradient. A micro-batch
    routes 2 x 32 tokens to 2 of the 4 experts each: every expert gets rows."""
    spy = runs["spy"]
    assert spy.all > spy.experts, (spy.experts, spy.all)
    forwards = 2 * 4 * 2 * 4
    assert spy.passes == {"forward": forwards, "backward": 2 * forwards}, spy.passes
    assert spy.experts == 3 * forwards, spy.experts
    assert runs["fp8 spied"][0] == runs["fp8"][0]


def test_fp8_moe_is_not_bf16(runs):
    diff = [abs(a - b) / b for a, b in zip(runs["fp8"], runs["bf16"])]
    assert max(diff[1:]) < 2e-3 and any(d > 1e-5 for d in diff[1:]), diff


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layouts_train_the_serial_fp8_model(runs, layout):
    want, got = runs["fp8"], runs["layouts"][layout]
    assert want[-1] < want[0] - 1.0, want                      # the run learns
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= FP8_LAYOUT_TOLERANCE * w, f"{layout} step {step}: {g} vs {w}"
