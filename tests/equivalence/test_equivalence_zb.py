"""Zero-bubble schedules through the real trainer and GPT model, against the serial run and 1F1B.

Every layout trains the same model on the same samples (fp32, dropout 0, mock data), so its losses
and grad norms over 20 steps must match the serial run's to a relative 1e-4 (docs/design.md): zb-h1
and zb-v at pp=2 and pp=4 with m = 1 (the smallest either allows), m < pp, m not a multiple of pp
and m > pp; combined with tp=2 and sequence parallelism, dp=2 with ZeRO-1, selective and full
recomputation, the llama block (untied output layer, RMSNorm, SwiGLU) and 1f1b-w. Under zb-v the
tied word embedding and the output layer are one parameter on rank 0. The gradients after one step
(main_grad, after the DP reduction and the tied / sequence-parallel sums) of zb-v, zb-h1 and 1F1B
must equal the serial run's within fp32 tolerance, parameter by parameter (each rank's TP slice of
the serial gradient); fp16 with the dynamic loss scaler and bf16 under zb-v and 1F1B must follow the
serial run in the same precision to 1e-4 (the schedule changes no rounding: the same micro-batches
run the same GEMMs); a checkpoint saved under zb-v resumes under 1f1b and back with the serial run's
losses. A user block that reads a norm's parameters both directly and through the module (B and W
both accumulate them) has zb-h1's reduced gradients equal 1F1B's at dp 2 with a bucket per
parameter. One spawned group per world size runs every layout in sequence.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

from engine.checkpoint import param_specs
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grads.main_grad import current_grad
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS = 20
GLOBAL_BATCH = 12
BASE = ["--mock-data", "--vocab-size", "256", "--no-progress", "--device", "cpu",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--global-batch-size", str(GLOBAL_BATCH), "--precision", "fp32",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--peak-tflops", "1", "--timeout-s", "120"]
REL = 1e-4
# zb-v on 4 stages needs 8 virtual stages: those layouts train 8 layers, against an 8-layer serial run
DEEP = ("--num-layers", "8")


def layout(pp: int, schedule: str, micro: int, *extra: str, tp: int = 1, dp: int = 1) -> list[str]:
    """Flags of one layout; ``micro`` is the number of micro-batches per step."""
    assert GLOBAL_BATCH % (micro * dp) == 0
    return ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--pipeline-schedule", schedule,
            "--micro-batch-size", str(GLOBAL_BATCH // (micro * dp)), *extra]


def train(argv: list[str], launch: LaunchEnv | None = None, steps: int = STEPS) -> dict:
    trainer = Trainer(parse_args(BASE + ["--train-iters", str(steps)] + argv), launch=launch)
    try:
        records = trainer.train().records
        tied = [c.tied_on_rank for c in trainer.chunks if c.post_process]
        # what the reducer, the offload and the compressors' residuals treat as a copy on another
        # stage (an all-reduce over the embedding group at each save) is what the step does
        marked = [id(p) for c in trainer.chunks for p in c.parameters()
                  if getattr(p, "tied_across_stages", False)]
        assert marked == [id(p) for c in trainer.chunks for p in c.shared_embedding_params()]
    finally:
        if launch is None:
            trainer.close()
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "loss_scale": [r["loss_scale"] for r in records], "tied_on_rank": tied}


def one_step_grads(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    """Every local parameter's gradient as the optimizer would see it after step 1, by logical
    name and TP rank (no clipping), with the offsets of its slice in the logical tensor: a list,
    one entry per copy (zb-v's first rank holds the tied embedding and its output copy)."""
    trainer = Trainer(parse_args(BASE + ["--train-iters", "1", "--clip-grad", "0"] + argv),
                      launch=launch)
    grads: dict = {}
    step = trainer.optimizer.step

    def capture(lr):
        specs = {sp.name: sp for sp in param_specs(trainer.chunks, trainer.ps,
                                                   trainer.cfg.model.vocab_size)}
        for chunk in trainer.chunks:
            for name, p in chunk.logical_named_parameters():
                copies = grads.setdefault(f"{name}@tp{trainer.ps.tp_rank}", [])
                if not any(p is q for q, _ in copies):   # a tied pair in one chunk: once
                    copies.append((p, (tuple(specs[name].offsets),
                                       current_grad(p).detach().clone())))
        return step(lr)

    trainer.optimizer.step = capture
    try:
        trainer.train()
    finally:
        if launch is None:
            trainer.close()
    return {key: [grad for _, grad in copies] for key, copies in grads.items()}


def assert_matches(result: dict, ref: dict, what: str, keys=("loss", "grad_norm"), rel=REL) -> None:
    for key in keys:
        assert len(result[key]) == len(ref[key]), (what, key)
        for step, (got, want) in enumerate(zip(result[key], ref[key]), start=1):
            assert abs(got - want) <= rel * abs(want), \
                f"{what}: {key} at step {step} is {got}, reference {want}"


def assert_serial_grads(per_rank: list[dict], what: str, tied_copies: int) -> None:
    """Every rank's gradients (one_step_grads) against its slice of the serial run's;
    ``tied_copies``: the parameters that hold the word embedding on TP rank 0 (2 when the first
    and the last stage are apart, 1 when zb-v puts both on rank 0 as one parameter)."""
    serial = serial_grads()
    logical = {k.rpartition("@")[0] for r in per_rank for k in r}
    want = {k.rpartition("@")[0] for k in serial}
    assert logical == want, (what, sorted(logical ^ want))
    # rank by rank: a tied embedding is held by the first and the last stage under one name, and
    # each copy must carry the whole gradient
    for rank, grads in enumerate(per_rank):
        for key, copies in grads.items():
            [(_, full)] = serial[key.rpartition("@")[0] + "@tp0"]
            for offsets, grad in copies:
                box = tuple(slice(o, o + n) for o, n in zip(offsets, grad.shape))
                torch.testing.assert_close(grad, full[box], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{what}: rank {rank} {key}: {m}")
    tied = sum(len(g.get("embedding.word.weight@tp0", [])) for g in per_rank)
    assert tied == tied_copies, f"{what}: {tied} copies of the tied embedding, not {tied_copies}"


@functools.lru_cache(maxsize=1)
def serial_runs() -> dict:
    """The serial references, computed once per test process (tests/parallel/tensor_parallel's
    overlap runs compare against them too)."""
    runs = {block: train(["--micro-batch-size", str(GLOBAL_BATCH), "--block", block], LaunchEnv())
            for block in ("gpt2", "llama")}
    runs["gpt2 deep"] = train(["--micro-batch-size", str(GLOBAL_BATCH), *DEEP], LaunchEnv())
    return runs


@functools.lru_cache(maxsize=1)
def serial_grads() -> dict:
    """The serial run's gradients after one step (one_step_grads), by logical name."""
    return one_step_grads(["--micro-batch-size", str(GLOBAL_BATCH)], LaunchEnv())


@functools.lru_cache(maxsize=1)
def serial_short() -> dict:
    """Serial 8-step runs (their learning-rate schedule is the 8-step one) in fp32, fp16, bf16."""
    return {p: train(["--micro-batch-size", str(GLOBAL_BATCH), "--precision", p,
                      "--initial-loss-scale", "65536"], LaunchEnv(), steps=8)
            for p in ("fp32", "fp16", "bf16")}


@pytest.fixture(scope="module")
def serial():
    return serial_runs()


PP2 = [
    layout(2, "zb-h1", 1),                              # the smallest m
    layout(2, "zb-h1", 3),
    layout(2, "zb-v", 1),                               # the smallest m
    layout(2, "zb-v", 3),
    layout(2, "zb-v", 4, "--recompute", "full"),
    layout(2, "zb-v", 2, "--block", "llama"),
    layout(2, "1f1b-w", 2),
]
PRECISION = [layout(2, s, 3, "--precision", p, "--initial-loss-scale", "65536")
             for p in ("fp16", "bf16") for s in ("1f1b", "zb-v")]


def pp2_group(ps, root: str) -> dict:
    out = {"layouts": [train(argv) for argv in PP2],
           "precision": [train(argv, steps=8) for argv in PRECISION]}
    out["grads"] = {s: one_step_grads(layout(2, s, 3)) for s in ("1f1b", "zb-v")}
    # checkpoints carry logical names: save under zb-v, resume under 1f1b, and back
    a, c = os.path.join(root, "zbv"), os.path.join(root, "1f1b")
    out["A"] = train(layout(2, "zb-v", 3, "--save", a, "--save-interval", "4"), steps=8)
    out["B"] = train(layout(2, "1f1b", 3, "--load", os.path.join(a, "iter_0000004")), steps=8)
    out["C"] = train(layout(2, "1f1b", 3, "--save", c, "--save-interval", "4"), steps=8)
    out["D"] = train(layout(2, "zb-v", 3, "--load", os.path.join(c, "iter_0000004")), steps=8)
    return out


def test_pp2_zero_bubble_matches_serial_1f1b_and_checkpoints(serial, tmp_path):
    results = run_distributed(pp2_group, grid=RankGrid(pp=2), args=(str(tmp_path),),
                              timeout_s=180)
    for i, argv in enumerate(PP2):
        what = " ".join(argv)
        block = "llama" if "llama" in argv else "gpt2"
        for r in results:   # every rank's records: the step's figures are global
            assert_matches(r["layouts"][i], serial[block], what)
        if "zb-v" in argv:   # the last virtual stage is on rank 0, its output layer the embedding
            assert results[0]["layouts"][i]["tied_on_rank"] == [block == "gpt2"], what
            assert results[1]["layouts"][i]["tied_on_rank"] == []
    short = serial_short()
    for run, argv in zip(results[0]["precision"], PRECISION):
        p, what = argv[argv.index("--precision") + 1], " ".join(argv)
        assert run["loss_scale"] == short[p]["loss_scale"], what
        assert_matches(run, short[p], f"{what} against serial {p}", keys=("loss",))
    for schedule in ("zb-v", "1f1b"):
        assert_serial_grads([r["grads"][schedule] for r in results], schedule,
                            tied_copies=1 if schedule == "zb-v" else 2)
    r = results[0]
    for run, what in ((r["A"], "zb-v"), (r["C"], "1f1b")):
        assert_matches(run, short["fp32"], f"{what} against serial", keys=("loss",))
    for run, what in ((r["B"], "zb-v -> 1f1b"), (r["D"], "1f1b -> zb-v")):
        assert_matches(run, {"loss": short["fp32"]["loss"][4:]}, what, keys=("loss",))


WORLD4 = [
    layout(4, "zb-h1", 2),                              # m < p (m > p: pp=2, m=3)
    layout(4, "zb-v", 1, *DEEP),                        # the smallest m
    layout(4, "zb-v", 3, "--recompute", "selective", *DEEP),
    layout(2, "zb-v", 2, "--sequence-parallel", tp=2),
    layout(2, "zb-h1", 3, "--sequence-parallel", "--recompute", "full", tp=2),
    layout(2, "zb-v", 3, tp=2),                         # scatter/gather over TP between stages
    layout(2, "zb-v", 1, "--use-distributed-optimizer", dp=2),
]


# a user block that reads a norm's weight directly and through the module (B and W both
# accumulate it), each parameter in a bucket of its own, dp 2: the reducer counts it once per
# micro-batch (counted twice, its bucket was reduced before the last W had added its share)
BOTH_WAYS = ["--block", "tests.helpers.blocks:BothWaysNormBlock", "--bucket-size-mb", "0.0001"]


def world4_group(ps) -> dict:
    out = {"layouts": [train(argv) for argv in WORLD4]}
    grads = {s: one_step_grads(layout(2, s, 2, "--sequence-parallel", tp=2))
             for s in ("1f1b", "zb-h1", "zb-v")}
    out["grads"] = grads
    out["both ways"] = {s: one_step_grads(layout(2, s, 3, *BOTH_WAYS, dp=2))
                        for s in ("1f1b", "zb-h1")}
    return out


def test_pp4_tp2_dp2_zero_bubble_match_serial_and_1f1b(serial):
    results = run_distributed(world4_group, grid=RankGrid(pp=4), timeout_s=180)
    for i, argv in enumerate(WORLD4):
        ref = serial["gpt2 deep" if "--num-layers" in argv else "gpt2"]
        for r in results:
            assert_matches(r["layouts"][i], ref, " ".join(argv))
    for schedule in ("1f1b", "zb-h1", "zb-v"):
        assert_serial_grads([r["grads"][schedule] for r in results], f"{schedule}, tp2 SP",
                            tied_copies=1 if schedule == "zb-v" else 2)
    for rank, r in enumerate(results):   # (the reference: 1F1B, which runs no W)
        want, got = r["both ways"]["1f1b"], r["both ways"]["zb-h1"]
        assert set(got) == set(want)
        for key, copies in want.items():
            for (offsets, a), (_, b) in zip(copies, got[key]):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"both ways, rank {rank} {key}: {m}")
