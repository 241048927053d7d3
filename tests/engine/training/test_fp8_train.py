"""FP8 training through the trainer: layouts against the serial FP8 run over 20 steps, checkpoints
interchangeable with bf16 runs, and the runs FP8 refuses.

Layouts (one spawned group of 4 gloo ranks, --fp8-format hybrid): (tp, pp, dp) = (2,1,2) with
sequence parallelism, tensorwise; tp 2 x pp 2 with sequence parallelism, the TP overlap's ring and
zb-h1's B/W split, rowwise; tp 2 x cp 2, tensorwise. Each is held to the serial FP8 run of its
recipe: every step's loss within a relative FP8_LAYOUT_TOLERANCE (docs/precision.md derives it:
a layout quantizes with the serial scales, so it differs from the serial FP8 run only where bf16
reassociation moves an input across an FP8 rounding boundary, a fraction of the elements FP8
already rounds; measured 4e-4 here, where FP8 itself moves the loss by up to 7e-4 from bf16).

Every rank of a layout runs each of its GEMMs in FP8: the calls of ``torch._scaled_mm`` it makes
are the count its layers, micro-batches and TP ring imply (a rank on bf16 GEMMs would pass the
tolerance alone).

Checkpoints: an FP8 run's checkpoint holds the tensors, shapes and dtypes of a bf16 run's; a bf16
run resumes from an FP8 checkpoint and an FP8 run from a bf16 one, each continuing within the
tolerance of the run it resumed (only the compute format of the GEMMs changes).
"""
from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.launch import main as train_main
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.corpus import real_text_corpus
from tests.helpers.dist_utils import run_distributed

STEPS = 20
FP8_LAYOUT_TOLERANCE = 1e-3
TENSORWISE = ["--fp8-format", "hybrid"]
ROWWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"]
LAYOUTS = {  # name: (recipe, layout flags)
    "(2,1,2) sp": (TENSORWISE, ["--tp", "2", "--dp", "2", "--sequence-parallel"]),
    "tp2 pp2 sp ring zb-h1": (ROWWISE, ["--tp", "2", "--pp", "2", "--sequence-parallel",
                                        "--tp-comm-overlap", "--pipeline-schedule", "zb-h1"]),
    "tp2 cp2": (TENSORWISE, ["--tp", "2", "--cp", "2"]),
}


def rank_gemms(layers: int, micro: int, ring: int = 1) -> int:
    """FP8 GEMMs of one rank over STEPS steps: per layer and micro-batch its 4 linears (QKV, the
    attention's output projection, fc1, fc2), each a forward, an input gradient and a weight
    gradient; the TP overlap's ring runs a forward and an input gradient as one GEMM per chunk
    (``ring``: tp of them)."""
    return STEPS * layers * micro * 4 * (2 * ring + 1)


# per rank: its layers (2 / pp) and micro-batches (16 / (4 x dp))
GEMMS = {"(2,1,2) sp": rank_gemms(2, 2), "tp2 pp2 sp ring zb-h1": rank_gemms(1, 4, ring=2),
         "tp2 cp2": rank_gemms(2, 4)}


def base(data: str, steps: int = STEPS) -> list[str]:
    return ["--data-path", data, "--no-progress", "--device", "cpu", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "16", "--micro-batch-size", "4", "--train-iters", str(steps),
            "--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--peak-tflops", "1",
            "--bf16", "--log-interval", "100"]


def serial(argv: list[str]) -> list[float]:
    return [r["loss"] for r in Trainer(parse_args(argv), launch=LaunchEnv()).train().records]


@contextlib.contextmanager
def counted_fp8_gemms():
    """Counts the calls of ``torch._scaled_mm`` (every FP8 GEMM kernels/fp8.py runs) inside."""
    calls, real = [0], torch._scaled_mm

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        yield calls
    finally:
        torch._scaled_mm = real


def train_all(ps, jobs: list[list[str]]) -> list[tuple[list[float], int]]:
    """Each job's losses and this rank's FP8 GEMMs."""
    out = []
    for argv in jobs:
        with counted_fp8_gemms() as calls:
            losses = [r["loss"] for r in Trainer(parse_args(argv)).train().records]
        out.append((losses, calls[0]))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return real_text_corpus(tmp_path_factory, "fp8_corpus")


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_ckpt")
    fp8_dir, bf16_dir = str(root / "fp8"), str(root / "bf16")
    out = {"fp8_dir": fp8_dir, "bf16_dir": bf16_dir}
    out["tensorwise"] = serial(base(data) + TENSORWISE + ["--save", fp8_dir, "--save-interval", "10"])
    out["rowwise"] = serial(base(data) + ROWWISE)
    out["bf16"] = serial(base(data, 12) + ["--save", bf16_dir, "--save-interval", "10"])
    step10 = lambda d: os.path.join(d, "iter_0000010")  # noqa: E731
    out["bf16 from fp8"] = serial(base(data, 12) + ["--load", step10(fp8_dir)])
    out["fp8 from bf16"] = serial(base(data, 12) + TENSORWISE + ["--load", step10(bf16_dir)])
    jobs = [base(data) + recipe + flags for recipe, flags in LAYOUTS.values()]
    ranks = run_distributed(train_all, grid=RankGrid(dp=4), args=(jobs,))
    out["layouts"] = {name: ranks[0][i][0] for i, name in enumerate(LAYOUTS)}   # rank 0's losses
    out["gemms"] = {name: [rank[i][1] for rank in ranks] for i, name in enumerate(LAYOUTS)}
    return out


def _within(got: list[float], want: list[float], tol: float, what: str) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= tol * w, f"{what} step {step}: {g} vs {w} ({abs(g - w) / w:.2e})"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_the_serial_fp8_model(runs, layout):
    recipe = "rowwise" if LAYOUTS[layout][0] is ROWWISE else "tensorwise"
    reference = runs[recipe]
    assert reference[-1] < reference[0] - 1.0, reference      # the run learns
    _within(runs["layouts"][layout], reference, FP8_LAYOUT_TOLERANCE, layout)
    # every rank runs its GEMMs in FP8, not a bf16 path the tolerance would let through
    assert runs["gemms"][layout] == [GEMMS[layout]] * 4, (runs["gemms"][layout], GEMMS[layout])


def test_fp8_is_not_bf16(runs):
    """The FP8 runs compute something else than bf16 (else the comparisons above prove nothing
    about FP8), close to it."""
    for recipe in ("tensorwise", "rowwise"):
        diff = [abs(a - b) / b for a, b in zip(runs[recipe], runs["bf16"])]
        assert max(diff) > 0 and max(diff[1:]) < 2e-3, (recipe, diff)
        assert any(d > 1e-5 for d in diff[1:]), (recipe, diff)


def _tensors(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "index.json")) as fh:
        index = json.load(fh)
    return {name: (t["shape"], t["dtype"]) for name, t in index["tensors"].items()}


def test_checkpoints_are_interchangeable_with_bf16(runs):
    fp8 = _tensors(os.path.join(runs["fp8_dir"], "iter_0000010"))
    bf16 = _tensors(os.path.join(runs["bf16_dir"], "iter_0000010"))
    assert fp8 == bf16 and fp8
    assert not any("float8" in dtype for _, dtype in fp8.values())
    # resumed at step 10 in the other compute format: steps 11 and 12 as the run it resumed
    _within(runs["bf16 from fp8"], runs["tensorwise"][10:12], FP8_LAYOUT_TOLERANCE, "bf16 from fp8")
    _within(runs["fp8 from bf16"], runs["bf16"][10:12], FP8_LAYOUT_TOLERANCE, "fp8 from bf16")


TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2"]


@pytest.mark.parametrize("extra,line", [
    (["--fp8-format", "hybrid"],
     "--fp8-format hybrid runs FP8 GEMMs on top of bf16 (fp32 masters, bf16 everywhere else), not "
     "with --precision fp32: add --bf16, or drop --fp8-format"),
    (["--fp16", "--fp8-format", "e4m3"], "not with --precision fp16: add --bf16"),
    (["--bf16", "--fp8-format", "e4m3", "--compile"], "--fp8-format e4m3 with --compile is not built"),
    (["--bf16", "--fp8-format", "e4m3", "--first-last-layers-bf16"],
     "--num-layers-at-start-in-bf16 1 and --num-layers-at-end-in-bf16 1 keep all 2 layers in "
     "bf16, so --fp8-format changes nothing; lower them or drop --fp8-format"),
    (["--bf16", "--fp8-format", "e5m2"], "argument --fp8-format: invalid choice: 'e5m2'"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
     "argument --fp8-recipe: invalid choice: 'delayed'"),
])
def test_fp8_refusals_are_one_line(extra, line, capsys):
    assert train_main(TINY + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gridtron: configuration error: ") and line in err[0], err


def test_a_chip_without_fp8_stops_before_any_process_group(monkeypatch):
    """The trainer asks the chip table with the device it bound (engine/device/chips.py): an
    A100 stops with the line naming it, before ParallelState exists."""
    from engine.device import runtime
    from engine.training import trainer as trainer_module
    a100 = runtime.DeviceInfo("cuda", runtime.torch.device("cpu"), "gloo", "NVIDIA A100-SXM4-80GB",
                              capability=(8, 0))
    monkeypatch.setattr(trainer_module, "setup_device", lambda *a, **k: a100)
    monkeypatch.setattr(trainer_module.ParallelState, "initialize",
                        lambda *a, **k: pytest.fail("a process group before the chip check"))
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB \(Ampere \(A100 class\)\) has "
                                          r"compute capability 8\.0"):
        Trainer(parse_args(TINY + ["--bf16", "--fp8-format", "hybrid"]), launch=LaunchEnv())


def test_the_compiled_quantization_trains_past_the_recompile_limit(monkeypatch):
    """On CUDA the quantization runs compiled (kernels/fp8.py): a model's GEMM operands and their
    gradients can be more signatures than Dynamo's recompile limit (dynamic sizes, but one per
    weight shape: Parameters stay static), where a bare ``torch.compile(..., fullgraph=True)``
    raises. Pointed at that path here (Dynamo's eager backend: the dispatch is under test, not
    inductor), with the process's limit set below this tiny model's signatures, a serial FP8 run
    compiles every signature (``Regional``'s own limit) and trains exactly the run of the eager
    path."""
    from kernels import fp8
    from kernels.compiled import Regional
    import torch
    argv = TINY + ["--bf16", "--fp8-format", "hybrid", "--train-iters", "3"]
    eager = serial(argv)
    regional = Regional(fp8._quantize, backend="eager", dynamic=True)  # as _compiled_quantize
    monkeypatch.setattr(fp8, "_compiled_quantize", lambda: regional)
    monkeypatch.setattr(fp8, "use_compiled_quantize", lambda x: not torch.compiler.is_compiling())
    torch._dynamo.reset()
    limit = 4   # the process's recompile limit, below the model's 6 signatures
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):   # (put back on leaving)
            assert serial(argv) == eager
    finally:
        torch._dynamo.reset()
    assert len(regional.compiled) > limit and not regional.eager, (regional.compiled, regional.eager)
