"""``--fp8-recipe blockwise`` through the trainer: layouts against the serial blockwise run over 20
steps, and the layouts it refuses.

Blockwise scales are each tile's own (kernels/fp8_blockwise.py), so a layout agrees with serial
without a reduction only where every tile is whole on one rank: hidden 256 with 4 heads (QKV 768,
MLP 256) splits over tp 2 into 128-multiples, and a 256-token sequence into 128-token chunks over
cp 2 (Ulysses: contiguous halves). One spawned group of 4 gloo ranks trains (global batch 2,
micro-batch 1) tp 2 x pp 2 with sequence parallelism, the TP overlap's chunked ring and zb-h1's
deferred weight gradients, then tp 2 x cp 2; each is held to the serial blockwise run within tests/engine/training/
test_fp8_train.py's FP8_LAYOUT_TOLERANCE (docs/precision.md: the same scales, so only bf16
reassociation moving an input across an FP8 rounding boundary differs).

Every rank runs each of its GEMMs in FP8: its calls of ``torch._scaled_mm`` are the tiles its
layers' GEMMs imply (``GEMMS``).

That bound alone would pass scales taken over each rank's shard instead of its tiles (FP8 moves
this run's loss by a few 1e-4 from bf16, and power-of-two scales of like-sized tiles only shift
exponents): tests/parallel/tensor_parallel/test_fp8_blockwise_layers.py holds every path of both
layers to the serial layer on operands whose tiles differ by more than e4m3's range, where a tile
cut anywhere else shows.
"""
from __future__ import annotations

import pytest

from engine.config.cli import parse_args
from engine.training.launch import main as train_main
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.engine.training.test_fp8_train import (FP8_LAYOUT_TOLERANCE, STEPS, _within,
                                                  counted_fp8_gemms)
from tests.helpers.corpus import real_text_corpus
from tests.helpers.dist_utils import run_distributed

BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
LAYOUTS = {
    "tp2 pp2 sp ring zb-h1": ["--tp", "2", "--pp", "2", "--sequence-parallel",
                              "--tp-comm-overlap", "--pipeline-schedule", "zb-h1"],
    "tp2 cp2 a2a": ["--tp", "2", "--cp", "2", "--cp-comm-type", "a2a"],
}


def tiles(*widths: int) -> int:
    return sum(w // 128 for w in widths)


# one rowwise FP8 GEMM per 128-wide tile of a GEMM's contraction (this CPU's per-tile path): per
# layer on one of tp 2, the forwards' (QKV, the output projection, fc1, fc2: inputs 256, 128,
# 256, 128), the input gradients' (their outputs: 384, 256, 128, 256) and the weight gradients'
# (the rank's tokens: 4 x their tiles)
FORWARD, DGRAD = tiles(256, 128, 256, 128), tiles(384, 256, 128, 256)


def layer_gemms(tokens: int, ring: int = 1) -> int:
    """A layer's FP8 GEMMs per micro-batch; ``ring``: the TP overlap's chunks of the forwards and
    input gradients."""
    return ring * (FORWARD + DGRAD) + 4 * tiles(tokens)


GEMMS = {  # per rank over STEPS steps of 2 micro-batches
    "tp2 pp2 sp ring zb-h1": STEPS * 2 * layer_gemms(256, ring=2),  # 1 layer; SP gathers 256 tokens
    "tp2 cp2 a2a": STEPS * 2 * 2 * layer_gemms(128),                 # 2 layers; 128 tokens a rank
}


def base(data: str) -> list[str]:
    return ["--data-path", data, "--no-progress", "--device", "cpu", "--num-layers", "2",
            "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
            "--seq-length", "256",
            "--global-batch-size", "2", "--micro-batch-size", "1", "--train-iters", str(STEPS),
            "--lr", "2e-4", "--min-lr", "2e-4", "--lr-warmup-iters", "0", "--peak-tflops", "1",
            "--bf16", "--log-interval", "100"]


def _losses(argv: list[str], launch=None) -> list[float]:
    return [r["loss"] for r in Trainer(parse_args(argv), launch=launch).train().records]


def _train_all(ps, jobs: list[list[str]]) -> list[tuple[list[float], int]]:
    """Each job's losses and this rank's FP8 GEMMs."""
    out = []
    for argv in jobs:
        with counted_fp8_gemms() as calls:
            losses = _losses(argv)
        out.append((losses, calls[0]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = real_text_corpus(tmp_path_factory, "fp8_blockwise_corpus")
    out = {"serial": _losses(base(data) + BLOCKWISE, LaunchEnv()),
           "bf16": _losses(base(data), LaunchEnv())}
    jobs = [base(data) + BLOCKWISE + flags for flags in LAYOUTS.values()]
    ranks = run_distributed(_train_all, grid=RankGrid(dp=4), args=(jobs,))
    out["layouts"] = {name: ranks[0][i][0] for i, name in enumerate(LAYOUTS)}   # rank 0's losses
    out["gemms"] = {name: [rank[i][1] for rank in ranks] for i, name in enumerate(LAYOUTS)}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_train_the_serial_blockwise_model(runs, layout):
    serial = runs["serial"]
    assert serial[-1] < serial[0] - 1.0, serial      # the run learns
    _within(runs["layouts"][layout], serial, FP8_LAYOUT_TOLERANCE, layout)
    # every rank runs its GEMMs in FP8, not a bf16 path the tolerance would let through
    assert runs["gemms"][layout] == [GEMMS[layout]] * 4, (runs["gemms"][layout], GEMMS[layout])


def test_blockwise_is_fp8_close_to_bf16(runs):
    """Not bf16 (else the comparison above proves nothing about FP8), and close to it."""
    diff = [abs(a - b) / b for a, b in zip(runs["serial"], runs["bf16"])]
    assert any(d > 1e-5 for d in diff[1:]) and max(diff) < 5e-3, diff


TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2",
        "--num-attention-heads", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--bf16"]


@pytest.mark.parametrize("extra,line", [
    (["--hidden-size", "64", "--seq-length", "32", "--fp8-format", "hybrid",
      "--fp8-recipe", "blockwise"],
     "--fp8-recipe blockwise runs every operand in e4m3 (DeepSeek-V3's recipe; PyTorch's "
     "blockwise kernel takes e4m3 only), not --fp8-format hybrid; use --fp8-format e4m3"),
    (["--hidden-size", "128", "--seq-length", "32", "--tp", "2", *BLOCKWISE],
     "--fp8-recipe blockwise at --tp 2 needs each rank's share of the QKV projection's width "
     "((heads + 2 groups) x head dim) (384 / 2) to be a multiple of 128"),
    (["--hidden-size", "256", "--ffn-hidden-size", "640", "--seq-length", "32", "--tp", "2",
      *BLOCKWISE], "share of --ffn-hidden-size (640 / 2) to be a multiple of 128"),
    (["--hidden-size", "64", "--seq-length", "256", "--cp", "2", *BLOCKWISE],
     "--fp8-recipe blockwise at --cp 2 needs each of the sequence's 4 context-parallel chunks "
     "(256 / 4 tokens) to be a multiple of 128, the weight gradient's token tiles; use a "
     "--seq-length that is a multiple of 512, or --fp8-recipe rowwise"),
])
def test_blockwise_refusals_are_one_line(extra, line, capsys):
    assert train_main(TINY + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gridtron: configuration error: ") and line in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_the_tile_rule_applies_to_a_shape_from_the_checkpoint(tmp_path):
    """--use-checkpoint-args takes the model's shape from --load after the flags are read: the
    tile rule (and the bf16-layers rule beside it) is asked again with that shape, so hidden 128
    from a checkpoint at --tp 2 is refused as it is when given."""
    from engine.base import ConfigError
    from engine.training.launch import run_config
    save = str(tmp_path / "ck")
    assert train_main(TINY + ["--hidden-size", "128", "--seq-length", "32", "--save", save,
                              "--run-dir", str(tmp_path / "run")]) == 0
    with pytest.raises(ConfigError, match="^--fp8-recipe blockwise at --tp 2 needs each rank's "
                                          "share of the QKV projection's width"):
        run_config(TINY + ["--seq-length", "32", "--load", save, "--use-checkpoint-args", "--tp",
                           "2", *BLOCKWISE])
    with pytest.raises(ConfigError, match="keep all 2 layers in bf16"):
        run_config(TINY + ["--seq-length", "32", "--load", save, "--use-checkpoint-args",
                           "--fp8-format", "e4m3", "--first-last-layers-bf16"])
    cfg = run_config(TINY + ["--seq-length", "32", "--load", save, "--use-checkpoint-args",
                             *BLOCKWISE])   # tp 1: any width is whole tiles
    assert cfg.model.hidden_size == 128 and cfg.precision.fp8_recipe == "blockwise"
