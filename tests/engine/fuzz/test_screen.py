"""``python -m engine.fuzz --screen``: its space, a seeded sample, and that it fails.

- Draws: 600 screening cases on up to 8 ranks, each accepted by the trainer's own validation
  (parse_args and validate_run) with no note that one of its screening flags does nothing,
  covering every value of every screening choice, on the layouts the plain fuzzer draws from the
  same seed; specs read back to the same case. A screening field is refused in one line, in the
  case's terms or the trainer's.
- The CI sample: three seeded cases on 2 ranks, 3 steps each, MoE with a capacity factor in each
  (bf16 with FP8, dropout, padding and the global aux loss under Ulysses CP and onebit
  compression; bf16 under TP with the expert TP; fp16's overflow skip with the global aux loss
  under CP, ZeRO-1, the whole optimizer offloaded and int8 compression), screened through the
  command line.
- fp16 whose one compression warm-up step overflows trains (the warm-up counts applied steps)
  under topk with ZeRO-1 and onebit with ZeRO-2.
- It can fail: a case passes, then with a defect planted in every rank (fp16's overflow skip
  decided by each rank alone; the compressed exchange sending twice the mean) the same case fails
  with the expected reason, and the reproducing command names --screen and the case's fields.
"""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest

from engine.config.cli import parse_args
from engine.fuzz import cli
from engine.fuzz.screen import (CAPACITIES, COMPRESSORS, FP8_RECIPES, PRECISIONS, SCREEN_FIELDS,
                                ScreenCase, draw_screen, screen_draws)
from engine.fuzz.space import Case, draws
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv
from tests.engine.fuzz import planted_screen

SEED, CASES = 11892, 3


def test_every_screen_draw_is_valid_and_every_choice_is_drawn():
    seen = collections.defaultdict(set)
    rng = random.Random(4)
    for _ in range(600):
        case = draw_screen(rng, 8)
        assert ScreenCase.parse(case.spec()) == case and case.problem() is None, case.spec()
        _, notes = validate_run(parse_args(case.argv(4)), LaunchEnv(0, case.world, 0, case.world))
        flags = [f for f in case.screen_flags() if f.startswith("--")]
        assert not [n for n in notes if any(f in n for f in flags)], (case.spec(), notes)
        for name in SCREEN_FIELDS:
            seen[name].add(getattr(case, name))
    assert seen["precision"] == set(PRECISIONS) and seen["fp8"] == set(FP8_RECIPES)
    assert seen["compression"] == set(COMPRESSORS) and seen["capacity"] == set(CAPACITIES)
    assert seen["dropout"] == {0, 10}
    for flag in ("overflow", "pad", "global_aux"):
        assert seen[flag] == {False, True}, flag
    layouts = [Case(**{f.name: getattr(c, f.name) for f in dataclasses.fields(Case)})
               for c in screen_draws(7, 8, 20)]
    assert layouts == draws(7, 8, 20)   # a seed screens the layouts it fuzzes


@pytest.mark.parametrize("argv,line", [
    (["--case", "dp=2,precision=bf16"], "--case dp=2,precision=bf16: precision is a screening "
                                        "field: add --screen"),
    (["--screen", "--case", "fp8=rowwise"], "--case fp8=rowwise: fp8=rowwise needs precision=bf16 "
                                            "(FP8 GEMMs run on top of bf16)"),
    (["--screen", "--case", "compression=int8"], "--case compression=int8: compression=int8 needs "
                                                 "dp x cp = 2 or more (nothing is exchanged to "
                                                 "compress)"),
    (["--screen", "--case", "precision=fp64"], "precision takes fp32, bf16, fp16, got fp64"),
    (["--screen", "--case", "dp=2,zero=3,compression=int8"],
     "gradient compression with --data-parallel-sharding-strategy optim_grads_params is not "
     "built; drop --grad-compression (and grad_compression_policy) or use optim_grads"),
])
def test_a_screen_case_is_refused_in_one_line(capsys, argv, line):
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    assert out.err.startswith("gridtron: --case ") and out.err.endswith(f"{line}\n"), out
    assert len(out.err.splitlines()) == 1 and out.out == "", out


def test_the_screen_sample_trains(capsys):
    sample = screen_draws(SEED, 4, CASES)
    assert {c.precision for c in sample} == {"bf16", "fp16"} and any(c.overflow for c in sample)
    assert {c.compression for c in sample} >= {"int8", "onebit"} and any(c.fp8 != "none" for c in sample)
    assert any(c.dropout for c in sample) and all(c.capacity for c in sample)
    argv = ["--screen", "--seed", str(SEED), "--cases", str(CASES), "--ranks", "4", "--steps", "3"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[:4] for line in lines[1:-1]] == \
        [["case", f"{i}:", "ok", c.spec()] for i, c in enumerate(sample, 1)], lines
    assert f"{CASES} combination(s) screened" in lines[-1]


@pytest.mark.parametrize("setup, case, why", [
    (planted_screen.overflow_skip_per_rank,
     ScreenCase(pp=2, layers=2, precision="fp16", overflow=True),
     "rank 1 skipped step 1 and rank 0 did not"),
    (planted_screen.exchange_by_half, ScreenCase(dp=2, compression="int8"),
     "the gradient norm differs at step 2")])
def test_a_planted_defect_fails_its_screen_case(capsys, monkeypatch, setup, case, why):
    argv = ["--screen", "--case", case.spec(), "--ranks", "2", "--steps", "3"]
    assert cli.main(argv) == 0, capsys.readouterr().out   # the case passes without the defect
    capsys.readouterr()
    real = cli.fuzz
    monkeypatch.setattr(cli, "fuzz", lambda *a, **k: real(*a, **{**k, "setup": setup}))
    assert cli.main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"case 1: FAILED {case.spec()}") and why in lines[2], lines
    assert lines[3] == f"reproduce: python -m engine.fuzz --screen --case {case.spec()} --steps 3"


@pytest.mark.parametrize("spec", ["dp=2,zero=1,precision=fp16,overflow=1,compression=topk",
                                  "dp=2,zero=2,precision=fp16,overflow=1,compression=onebit"])
def test_a_skipped_compression_warmup_step_is_not_counted(capsys, spec):
    """fp16's first step overflows and is skipped; it is the one warm-up step, so the warm-up runs
    again: compression that started at step 2 froze a second moment no update had set and trained
    into NaN at step 3 under ZeRO (found by this screen)."""
    assert cli.main(["--screen", "--case", spec, "--ranks", "2", "--steps", "3"]) == 0, \
        capsys.readouterr().out
