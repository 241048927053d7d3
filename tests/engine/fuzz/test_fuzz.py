"""``python -m engine.fuzz``: its space, a fixed seeded sample against serial, and that it fails.

- Draws: 600 cases on up to 8 ranks, each accepted by the trainer's own validation (parse_args
  and validate_run: nothing the fuzzer draws is refused after launch), covering every value of
  every choice; specs read back to the same case.
- The CI sample: the seeded draws below on up to 4 ranks, 3 steps each, trained under the stream
  checker against the serial run through the command line (docs/testing.md: a longer fuzz).
- It can fail: with a defect planted in every rank (the overlapped gather's waits back in the
  owning modules; the DP reduction summing instead of averaging; validation reading its loss from
  the last pipeline rank under zb-v) one case each fails, naming the
  violation or the step whose loss differs, with the command that reproduces it.
"""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest

from engine.config.cli import parse_args
from engine.fuzz import cli
from engine.fuzz.space import Case, draw, draws
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv
from tests.helpers import planted

SEED, CASES = 20261204, 5


def test_every_draw_is_valid_and_every_choice_is_drawn():
    seen = collections.defaultdict(set)
    rng = random.Random(3)
    for _ in range(600):
        case = draw(rng, 8)
        assert Case.parse(case.spec()) == case and case.problem() is None, case.spec()
        validate_run(parse_args(case.argv(4)), LaunchEnv(0, case.world, 0, case.world))
        for f in dataclasses.fields(case):
            seen[f.name].add(getattr(case, f.name))
    assert seen["schedule"] == {"gpipe", "1f1b", "interleaved", "1f1b-w", "zb-h1", "zb-v"}
    assert seen["block"] == {"gpt2", "llama", "user"} and seen["recompute"] == {"none", "selective", "full"}
    assert seen["tp"] == {1, 2, 4} and seen["cp"] == seen["pp"] == seen["dp"] == {1, 2, 4, 8}
    assert seen["ep"] == {1, 2, 4} and seen["etp"] == {1, 2, 4} and seen["zero"] == {0, 1, 2, 3}
    assert seen["offload"] == {0, 50, 100}
    assert seen["cp_comm"] == {"p2p", "a2a"} and seen["dispatcher"] == {"alltoall", "allgather"}
    assert seen["router"] == {"softmax", "sigmoid"} and seen["moe_freq"] == {1, 2}
    assert seen["order"] == {"tp-cp-dp-pp", "tp-cp-pp-dp", "dp-tp-cp-pp"} and seen["end_weight"] == {0, 1}
    for flag in ("sp", "tp_overlap", "overlap_gather", "overlap_reduce", "gqa", "packed", "moe",
                 "grouped", "qk_norm"):
        assert seen[flag] == {False, True}, flag


def test_a_spec_is_refused_in_one_line(capsys):
    assert cli.main(["--case", "tp=3,dp=1"]) == 2
    assert "--num-attention-heads 4 is not divisible by --tp 3" in capsys.readouterr().err
    assert cli.main(["--case", "tensor=2"]) == 2
    assert "'tensor=2' is not field=value with a field of tp" in capsys.readouterr().err
    assert cli.main(["--steps", "1", "--cases", "1"]) == 2


@pytest.mark.parametrize("argv,line", [
    (["--ranks", "2", "--case", "tp=4,dp=2"],
     "--case tp=4,dp=2 needs 8 ranks, more than --ranks 2: raise --ranks or choose a smaller case"),
    (["--case", "tp=4,dp=4"],
     "--case tp=4,dp=4 needs 16 ranks, more than the 8 the fuzzer runs: choose a smaller case"),
    (["--case", "zero=9"], "--case zero=9: zero takes 0 (the plain optimizer) or 1, 2, 3 (the "
                           "distributed optimizer's ZeRO stage), got 9"),
    (["--case", "dp=2,zero=1,offload=150"], "--case dp=2,zero=1,offload=150: offload takes the "
                                            "percent of the optimizer state kept in host memory, "
                                            "0 (none) to 100, got 150"),
    (["--case", "dp=2,zero=1,offload=-5"], "offload takes the percent of the optimizer state kept "
                                           "in host memory, 0 (none) to 100, got -5"),
    (["--case", "offload=1,zero=0"], "--case offload=1,zero=0: offload=1 needs zero=1, 2 or 3 (it "
                                     "offloads the distributed optimizer's state)"),
    (["--case", "dp=2,ep=2"], "--case dp=2,ep=2: ep=2 needs moe=1"),
    (["--case", "schedule=zb-v"], "--case schedule=zb-v: schedule=zb-v needs pp=2 or more"),
    (["--case", "tp=0"], "--case tp=0: tp takes 1 or more, got 0"),
    (["--case", "block=gpt3"], "--case block=gpt3: block takes gpt2, llama, user, got gpt3"),
    (["--case", "sp=5"], "--case 'sp=5': sp takes 0 or 1, got '5'"),
])
def test_a_case_is_refused_in_its_own_terms(capsys, argv, line):
    """A case's fields are checked as fields (not as the engine.train flags they become), and a
    case is never run on more processes than --ranks allows."""
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    assert out.err.startswith("gridtron: --case ") and out.err.endswith(f"{line}\n"), out
    assert len(out.err.splitlines()) == 1 and out.out == "", out


def test_the_ci_sample_trains_the_serial_model(capsys):
    sample = draws(SEED, 4, CASES)
    assert len({c.world for c in sample}) >= 2 and any(c.moe for c in sample)
    assert cli.main(["--seed", str(SEED), "--cases", str(CASES), "--ranks", "4", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 3)[:3] for line in lines[1:-1]] == \
        [["case", f"{i}:", "ok"] for i in range(1, CASES + 1)], lines
    assert [line.split(" ")[3] for line in lines[1:-1]] == [c.spec() for c in sample]
    assert f"{CASES} combination(s) equal to the serial run" in lines[-1]


@pytest.mark.parametrize("setup, case, why", [
    (planted.gather_in_owning_modules,
     Case(dp=2, zero=1, overlap_gather=True, block="llama", bucket_kb=1),
     "stream-order violation(s), the first: read after an unordered write"),
    (planted.sum_instead_of_mean, Case(dp=2), "grad_norm differs at step 1"),
    (planted.validation_from_the_last_rank, Case(pp=2, schedule="zb-v", layers=4),
     "the validation loss differs at evaluation 1")])
def test_a_planted_defect_fails_its_case(setup, case, why):
    lines = []
    done, failed = cli.fuzz([Case(), case], 3, 120.0, setup=setup, say=lines.append)
    assert done == 2 and lines[0].startswith("case 1: ok")   # serial: nothing to differ
    assert failed is not None and failed[0] == case and why in failed[1], failed
    assert lines[1].startswith(f"case 2: FAILED {case.spec()}")
