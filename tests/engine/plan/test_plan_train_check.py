"""The planner's flags that engine.train shares go through engine.train's own checks
(engine/tools/train_check.py): a combination engine.train refuses is refused by the plan with
engine.train's line, a flag engine.train notes as having no effect gets its note, and the command
the plan prints is one engine.train's parser takes without a note. engine.train's lines are read
from engine.train itself (its parser and its notes), never copied here."""
from __future__ import annotations

import json
import shlex

import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.tools import plan_cli
from engine.config.unused_flags import unused_flag_notes

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "512", "--vocab-size", "1000", "--global-batch-size", "16"]
PLAN = MODEL + ["--device", "h100", "--devices", "8"]
TRAIN = MODEL + ["--mock-data", "--micro-batch-size", "1"]


def train_refusal(flags: list[str]) -> str:
    """engine.train's line for its flags ``flags`` over the same model."""
    with pytest.raises(ConfigError) as exc:
        parse_args(TRAIN + flags)
    return str(exc.value)


def train_notes(flags: list[str], world: int = 1) -> list[str]:
    """engine.train's notes for its flags ``flags`` over the same model."""
    cfg = parse_args(TRAIN + flags)
    return unused_flag_notes(cfg, cfg.parallel.grid(world), "cuda", False)


def plan(capsys, *extra: str) -> tuple[int, str, str]:
    code = plan_cli.main(PLAN + list(extra))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def printed_command(out: str) -> list[str]:
    """engine.train's arguments in the plan's last line."""
    return shlex.split(out.rstrip().splitlines()[-1].split(" -m engine.train ")[1])


REFUSED = {  # the plan's flags -> engine.train's flags of the same run
    "fp16 with FP8": (["--precision", "fp16", "--fp8-format", "e4m3"],
                      ["--precision", "fp16", "--fp8-format", "e4m3"]),
    "overlap, sequence parallelism off": (["--tp-comm-overlap", "--sequence-parallel", "off"],
                                          ["--tp", "2", "--tp-comm-overlap",
                                           "--no-sequence-parallel"]),
    "overlap, sequence parallelism off, one layout": (
        ["--tp-comm-overlap", "--sequence-parallel", "off", "--layout", "4,1"],
        ["--tp", "4", "--tp-comm-overlap", "--no-sequence-parallel"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_train_refuses_the_plan_refuses_with_trains_line(name, capsys):
    flags, train_flags = REFUSED[name]
    code, out, err = plan(capsys, *flags)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"gridtron: {train_refusal(train_flags)}"], err


def test_trains_advice_is_a_plan_flag_too(capsys):
    """engine.train's lines say "add --bf16" and "add --sequence-parallel": both are plan flags."""
    code, out, _ = plan(capsys, "--bf16", "--fp8-format", "e4m3", "--top", "1")
    assert code == 0 and parse_args(printed_command(out)).precision.precision == "bf16"
    code, out, _ = plan(capsys, "--tp-comm-overlap", "--sequence-parallel", "--layout", "2,1",
                        "--top", "1")
    assert code == 0 and "--tp-comm-overlap" in printed_command(out)
    code, _, err = plan(capsys, "--bf16", "--precision", "fp16")
    assert code == 2 and "not allowed with" in err and err.count("\n") == 1


def test_a_flag_train_notes_gets_trains_note(capsys):
    code, out, err = plan(capsys, "--fp8-recipe", "rowwise", "--top", "1")
    note = train_notes(["--fp8-recipe", "rowwise"])
    assert code == 0 and len(note) == 1
    assert err.splitlines() == [f"gridtron: note: {note[0]}"], err
    assert "--fp8-recipe" not in printed_command(out)   # planned and printed without FP8


def test_tp_comm_overlap_plans_sequence_parallelism_and_notes_tp_1(capsys):
    """engine.train runs --tp-comm-overlap with sequence parallelism only: with --sequence-parallel
    both every layout with tp > 1 is planned with it (none dropped the flag); where the best layout
    has tp 1 the flag gets engine.train's note for tp 1."""
    code, out, err = plan(capsys, "--tp-comm-overlap", "--json", "--top", "1000")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and any(r["tp"] > 1 for r in rows)
    for r in rows:
        assert r["sequence_parallel"] == (r["tp"] > 1), r
        command = shlex.split(r["command"].split(" -m engine.train ")[1])
        assert ("--tp-comm-overlap" in command) == (r["tp"] > 1)
        assert parse_args(command).parallel.tp_comm_overlap == (r["tp"] > 1)
    if rows[0]["tp"] == 1:
        note = train_notes(["--tp-comm-overlap", "--sequence-parallel"])
        assert f"gridtron: note: {note[-1]}" in err.splitlines(), err
    code, out, err = plan(capsys, "--tp-comm-overlap", "--layout", "1,1", "--top", "1")
    notes = train_notes(["--tp-comm-overlap", "--sequence-parallel"])
    tp_note = next(n for n in notes if n.startswith("--tp-comm-overlap"))
    assert code == 0 and err.splitlines() == [f"gridtron: note: {tp_note}"], err


@pytest.mark.parametrize("extra", [
    ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--tp-comm-overlap", "--layout", "2,2",
     "--zero", "on"],
    ["--fp8-format", "hybrid", "--layout", "1,1", "--precision", "bf16"],
    ["--layout", "2,1", "--sequence-parallel", "on", "--overlap-grad-reduce", "off"],
], ids=["fp8 overlap pp2", "fp8 pp1", "sp no grad overlap"])
def test_printed_command_is_taken_by_train_without_a_note(extra, capsys):
    code, out, err = plan(capsys, *extra, "--top", "1")
    assert code == 0 and err == "", err
    argv = printed_command(out)
    cfg = parse_args(argv)            # engine.train's parser takes it ...
    world = 8
    notes = unused_flag_notes(cfg, cfg.parallel.grid(world), "cuda", False)
    assert notes == [], notes         # ... and notes no flag of it as having no effect
    p = cfg.precision
    if "--fp8-format" in extra:
        assert (p.precision, p.fp8_format) == ("bf16", extra[extra.index("--fp8-format") + 1])
    if "--tp-comm-overlap" in extra:
        assert cfg.parallel.tp_comm_overlap and cfg.parallel.sequence_parallel
    if cfg.parallel.pp == 1:
        assert "--pipeline-schedule" not in argv and "--virtual-pipeline-size" not in argv
