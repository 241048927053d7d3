"""FP8 scales over the logical tensor, through the trainer, at (tp, pp, dp) = (1,1,1), (2,1,1)
with sequence parallelism and (2,2,2).

One optimizer step of a two-layer GPT in --fp8-format hybrid (tensorwise): each layer's QKV,
attention output and MLP GEMMs record, per micro-batch, the scales of x, W (forward) and dy
(backward) and the largest magnitude of the piece of each that the rank held
(tests/helpers/fp8_scales.py). A TP rank holds a shard of W, of dy's features and, under
sequence parallelism, of x's tokens; a DP rank holds other micro-batches, a pipeline stage other
layers.

- Each scale is the scale of its whole logical tensor in that layout: max_fp8 / (the largest of
  the TP ranks' local amaxes of that call), exactly, and the same on both TP ranks.
- Where the layouts hold the same logical tensor bit for bit, the scales are the serial run's
  exactly: every weight at the first step, and the first layer's input. The other tensors differ
  between layouts by bf16 reassociation of row-parallel partial sums and its FP8 re-rounding
  downstream, so their scales are each layout's own (checked above), not the serial run's bits;
  tests/parallel/tensor_parallel/test_fp8_layers.py holds every path to the serial scales on
  equal tensors, exactly.
"""
from __future__ import annotations

import pytest
import torch

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.corpus import real_text_corpus
from tests.helpers.dist_utils import run_distributed
from tests.helpers.fp8_scales import ScaleRecorder

GLOBAL, MICRO = 8, 2


def argv(data: str, *extra: str) -> list[str]:
    return ["--data-path", data, "--no-progress", "--device", "cpu", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", str(GLOBAL), "--micro-batch-size", str(MICRO),
            "--train-iters", "1", "--lr", "1e-3", "--peak-tflops", "1", "--bf16",
            "--fp8-format", "hybrid", *extra]


def scales_of_one_step(ps, args: list[str]) -> dict:
    """{(pass, weight, global micro-batch): [(scale, local amax), ...]} of this rank's calls."""
    with ScaleRecorder() as rec:
        trainer = Trainer(parse_args(args), launch=LaunchEnv() if ps is None else None)
        trainer.train()
    names = {id(p): n for c in trainer.chunks for n, p in c.logical_named_parameters()}
    dp = trainer.ps.dp_rank
    local = GLOBAL // MICRO // trainer.ps.dp_size
    out = {}
    for (what, name), calls in rec.by_weight(names).items():
        for j, entry in enumerate(calls):
            out[(what, name, dp * local + j)] = entry
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = real_text_corpus(tmp_path_factory, "fp8_scales")
    serial = scales_of_one_step(None, argv(data))
    sp = run_distributed(scales_of_one_step, grid=RankGrid(tp=2),
                         args=(argv(data, "--tp", "2", "--sequence-parallel"),))
    grid3 = run_distributed(scales_of_one_step, grid=RankGrid(tp=2, pp=2, dp=2),
                            args=(argv(data, "--tp", "2", "--pp", "2", "--dp", "2"),))
    return serial, {"(2,1,1) sp": sp, "(2,2,2)": grid3}


def _scale(amax: float, what: str) -> float:
    top = torch.finfo(torch.float8_e4m3fn if what == "forward" else torch.float8_e5m2).max
    return torch.tensor(top / max(amax, 1e-12), dtype=torch.float64).float().item()


def test_every_layout_uses_its_logical_tensors_scales_and_the_serials_where_they_agree(runs):
    serial, layouts = runs
    assert len(serial) == 2 * 4 * 4 * 2   # 2 layers x 4 GEMMs x 4 micro-batches x 2 passes
    for key, entries in serial.items():   # the serial run: its whole tensors' scales
        assert all(s == _scale(a, key[0]) for s, a in entries), (key, entries)
    first_input = ("forward", "layers.0.attn.qkv.weight")
    for layout, ranks in layouts.items():
        calls: dict = {}
        for rank in ranks:
            for key, entries in rank.items():
                calls.setdefault(key, []).append(entries)
        assert calls.keys() == serial.keys(), (layout, set(calls) ^ set(serial))
        for key, peers in calls.items():
            assert len(peers) == 2, (layout, key)            # both TP ranks ran the call
            for i, pieces in enumerate(zip(*peers)):        # x and W, or dy
                scales = {s for s, _ in pieces}
                assert len(scales) == 1, (layout, key, i, pieces)   # one scale on every TP rank
                got = scales.pop()
                assert got == _scale(max(a for _, a in pieces), key[0]), (layout, key, i, pieces)
                want = serial[key][i][0]
                if (key[0] == "forward" and i == 1) or (key[:2] == first_input and i == 0):
                    assert got == want, (layout, key, i, got, want)
