"""Pipeline parallelism through the real trainer and GPT model, against the serial run.

Every layout trains the same model on the same samples, so its per-step losses and gradient norms
must match the serial run's (fp32, dropout 0, mock data) to a relative 1e-4. The grad norm is
compared too because AdamW is nearly invariant to a uniform gradient scale: a missing division by
the micro-batch count would barely move the losses, but it moves the norm.

Layouts cover GPipe, 1F1B and interleaved (vp=2) at pp=2 and pp=4, with micro-batch counts below
pp and not a multiple of pp, combined with tp=2 and sequence parallelism; the tied word embedding
of gpt2 must stay identical on the first and the last stage; llama (untied, RMSNorm, RoPE, SwiGLU)
runs once. One spawned group per world size runs several layouts in sequence.
"""
from __future__ import annotations

import pytest
import torch

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS = 20
GLOBAL_BATCH = 12          # micro-batch counts 1, 2, 3, 4, 6 and 12 are all reachable
BASE = ["--mock-data", "--vocab-size", "512", "--no-progress", "--device", "cpu",
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", str(STEPS), "--precision", "fp32", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--peak-tflops", "1"]
REL = 1e-4


def layout(tp: int, pp: int, schedule: str, micro: int, *extra: str) -> list[str]:
    """Flags of one layout; ``micro`` is the number of micro-batches per step (dp = 1 here)."""
    assert GLOBAL_BATCH % micro == 0
    return ["--tp", str(tp), "--pp", str(pp), "--pipeline-schedule", schedule,
            "--micro-batch-size", str(GLOBAL_BATCH // micro), *extra]


def train(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    """Train one layout; per-step losses and grad norms, and this rank's tied-embedding copies."""
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    records = trainer.train().records
    tied = {}
    for chunk in trainer.chunks:
        if chunk.pre_process:
            tied["first"] = chunk.embed.weight.detach().clone()
        if chunk.post_process and hasattr(chunk, "output_weight"):
            tied["last"] = chunk.output_weight.detach().clone()
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "tied": tied, "tp_rank": trainer.ps.tp_rank, "pp_rank": trainer.ps.pp_rank,
            "vocab_start": trainer.chunks[0].vocab_start}


def train_layouts(ps, layouts: list[list[str]]) -> list[dict]:
    return [train(argv) for argv in layouts]


def assert_matches(result: dict, ref: dict, what: str) -> None:
    for key in ("loss", "grad_norm"):
        assert len(result[key]) == STEPS, (what, key, result[key])
        for step, (got, want) in enumerate(zip(result[key], ref[key]), start=1):
            assert abs(got - want) <= REL * abs(want), \
                f"{what}: {key} at step {step} is {got}, serial {want}"


def assert_tied(per_rank: list[dict], ref: dict, what: str) -> None:
    """Both copies of the word embedding equal each other (bitwise) and the serial weight."""
    by_tp: dict[int, dict] = {}
    for r in per_rank:
        by_tp.setdefault(r["tp_rank"], {}).update(r["tied"])
    for tp_rank, copies in by_tp.items():
        assert set(copies) == {"first", "last"}, (what, tp_rank, sorted(copies))
        assert torch.equal(copies["first"], copies["last"]), \
            f"{what}: tied embedding copies differ on tp rank {tp_rank}"
        start = next(r["vocab_start"] for r in per_rank if r["tp_rank"] == tp_rank and r["pp_rank"] == 0)
        serial = ref["tied"]["first"][start:start + copies["first"].shape[0]]
        torch.testing.assert_close(copies["first"][:serial.shape[0]], serial, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{what}: embedding differs from serial: {m}")


@pytest.fixture(scope="module")
def serial():
    """The serial runs (gpt2 and llama), once per module."""
    return {block: train(["--micro-batch-size", str(GLOBAL_BATCH), "--block", block], LaunchEnv())
            for block in ("gpt2", "llama")}


PP2 = [
    layout(1, 2, "gpipe", 1),                          # m < p
    layout(1, 2, "gpipe", 3),                          # m not a multiple of p
    layout(1, 2, "1f1b", 3),
    layout(1, 2, "1f1b", 6),
    layout(1, 2, "interleaved", 2, "--vp", "2"),
    layout(1, 2, "interleaved", 4, "--vp", "2"),
    layout(1, 2, "1f1b", 3, "--block", "llama"),
]


def test_pp2_schedules_match_serial(serial):
    results = run_distributed(train_layouts, grid=RankGrid(pp=2), args=(PP2,))
    for i, argv in enumerate(PP2):
        what = " ".join(argv)
        block = "llama" if "llama" in argv else "gpt2"
        for rank_results in results:   # every rank's records: the step's figures are global
            assert_matches(rank_results[i], serial[block], what)
        if block == "gpt2":
            assert_tied([results[r][i] for r in range(2)], serial["gpt2"], what)
        else:
            # untied: the first stage holds only the embedding, the last only output.weight
            assert set(results[0][i]["tied"]) == {"first"} and set(results[1][i]["tied"]) == {"last"}


PP4_AND_TP2 = [
    layout(1, 4, "gpipe", 2),                          # m < p
    layout(1, 4, "1f1b", 3),                           # m < p, not a multiple
    layout(1, 4, "1f1b", 6),                           # m > p, not a multiple
    layout(1, 4, "interleaved", 4, "--vp", "2"),
    layout(2, 2, "gpipe", 2),
    layout(2, 2, "1f1b", 3, "--sequence-parallel"),
    layout(2, 2, "interleaved", 2, "--vp", "2", "--sequence-parallel"),
]


def test_pp4_and_tp2_pp2_match_serial(serial):
    results = run_distributed(train_layouts, grid=RankGrid(tp=1, pp=4), args=(PP4_AND_TP2,))
    for i, argv in enumerate(PP4_AND_TP2):
        what = " ".join(argv)
        for rank_results in results:
            assert_matches(rank_results[i], serial["gpt2"], what)
        assert_tied([results[r][i] for r in range(4)], serial["gpt2"], what)
