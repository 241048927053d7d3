"""Grouped-query attention and packed documents through the real trainer, against the serial run;
with the plain gpt2 model, docs/design.md's 20-step equivalence for one layout of each kind.

The plain gpt2 model and both blocks with and without packed documents (--reset-attention-mask
--reset-position-ids --eod-mask-loss), three of them with grouped-query attention, train 20 steps
under tp=2 (with sequence parallelism), pp=2 (1F1B), dp=2 (ZeRO-1) and (tp, pp, dp) = (2, 2, 2)
(each layout a packed and an unpacked model, the two-rank layouts all five), with micro-batches
of 2 sequences (of 4 under tp=2 alone: two per step) where the serial run takes one of 8;
per-step losses and grad norms must equal the serial run's to docs/design.md's relative 1e-4. The
mock vocabulary is small so that its end-of-document token (the last id) opens a new document
about every 24 tokens, and micro-batches hold different numbers of unmasked tokens: a
per-micro-batch mean would not match the global-batch mean.
"""
from __future__ import annotations

import pytest

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS, REL = 20, 1e-4
BASE = ["--mock-data", "--vocab-size", "24", "--no-progress", "--device", "cpu",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--global-batch-size", "8", "--train-iters", str(STEPS),
        "--precision", "fp32", "--lr", "3e-3", "--lr-warmup-iters", "0", "--peak-tflops", "1"]
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
MODELS = {"gpt2": ["--block", "gpt2"],
          "llama G=2": ["--block", "llama", "--num-query-groups", "2"],
          "llama G=2 packed": ["--block", "llama", "--num-query-groups", "2", *PACKED],
          "gpt2 packed": ["--block", "gpt2", *PACKED],
          "gpt2 G=2": ["--block", "gpt2", "--num-query-groups", "2"]}
# layout: (its flags, the models it trains): every layout a packed and an unpacked model, the
# two-rank layouts between them all five, both blocks packed and not
LAYOUTS = {"tp=2 sp": (["--tp", "2", "--sequence-parallel"], ["llama G=2 packed", "gpt2 G=2", "gpt2"]),
           "pp=2": (["--pp", "2"], ["gpt2 packed", "llama G=2"]),
           "dp=2 zero": (["--dp", "2", "--use-distributed-optimizer"], ["llama G=2 packed", "gpt2"]),
           "tp=2 pp=2 dp=2": (["--tp", "2", "--pp", "2", "--dp", "2", "--sequence-parallel"],
                              ["llama G=2 packed", "gpt2 G=2"])}


def train(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    try:
        records = trainer.train().records
    finally:
        trainer.close()
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}


def train_all(ps, jobs: list[tuple[str, str, list[str]]]) -> dict:
    return {(model, layout): train(argv) for model, layout, argv in jobs}


def jobs_for(layouts: list[str]) -> list[tuple[str, str, list[str]]]:
    return [(m, name, MODELS[m] + LAYOUTS[name][0] +
             ["--micro-batch-size", "4" if name == "tp=2 sp" else "2"])
            for name in layouts for m in LAYOUTS[name][1]]


@pytest.fixture(scope="module")
def serial() -> dict:
    return {m: train(flags + ["--micro-batch-size", "8"], LaunchEnv()) for m, flags in MODELS.items()}


def assert_matches(results: dict, serial: dict) -> None:
    for (model, layout), got in results.items():
        want = serial[model]
        for key in ("loss", "grad_norm"):
            assert len(got[key]) == STEPS, (model, layout, key)
            for step, (a, b) in enumerate(zip(got[key], want[key]), start=1):
                assert abs(a - b) <= REL * abs(b), f"{model} {layout}: {key} at step {step} is {a}, serial {b}"


def test_serial_runs_differ(serial):
    """Packing changes the losses by far more than the tolerance: the packed runs test packing.
    Each packed model against the same model with the end-of-document loss mask alone (the
    mask changes the mean by itself): what is left is the attention mask and the position reset
    reaching the model, so a trainer that dropped them would fail here."""
    for plain, packed in (("llama G=2", "llama G=2 packed"), ("gpt2", "gpt2 packed")):
        masked = train(MODELS[plain] + ["--eod-mask-loss", "--micro-batch-size", "8"], LaunchEnv())
        for a, what in ((serial[plain]["loss"], plain), (masked["loss"], plain + " eod mask")):
            b = serial[packed]["loss"]
            assert max(abs(x - y) / y for x, y in zip(a, b)) > 10 * REL, (what, packed)


def test_the_layouts_cover_every_model():
    two_rank = {m for name in ("tp=2 sp", "pp=2", "dp=2 zero") for m in LAYOUTS[name][1]}
    assert two_rank == set(MODELS)
    for name, (_, models) in LAYOUTS.items():
        assert any("packed" in m for m in models) and any("packed" not in m for m in models), name


def test_two_rank_layouts_match_serial(serial):
    jobs = jobs_for(["tp=2 sp", "pp=2", "dp=2 zero"])
    results = run_distributed(train_all, grid=RankGrid(dp=2), args=(jobs,))
    for rank_results in results:   # every rank's records: the step's figures are global
        assert_matches(rank_results, serial)


def test_3d_layout_matches_serial(serial):
    jobs = jobs_for(["tp=2 pp=2 dp=2"])
    results = run_distributed(train_all, grid=RankGrid(tp=2, pp=2, dp=2), args=(jobs,))
    for rank_results in results:   # every rank's records: the step's figures are global
        assert_matches(rank_results, serial)
