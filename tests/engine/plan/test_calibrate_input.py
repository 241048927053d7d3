"""``--calibrate``: a metrics file whose step time is not a finite number of seconds above 0 is
refused with one line naming the file and the line (exit 2), instead of a traceback or a fit to a
meaningless time; a null step time (not known yet) is left out."""
from __future__ import annotations

import json

import pytest

from engine.plan.calibrate import measured_step_time
from engine.tools import plan_cli
from tests.engine.plan.test_plan import ARGS, PAPER_FLAGS

BAD_STEP_TIMES = ["0.5", -0.5, 0, 0.0, True, [1.0]]


def _metrics(tmp_path, value) -> str:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "step_time_s": 1.0}, {"step": 2, "step_time_s": 1.0},
            {"step": 3, "step_time_s": value}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("value", BAD_STEP_TIMES, ids=repr)
def test_bad_step_time_is_one_line_naming_file_and_line(tmp_path, capsys, value):
    path = _metrics(tmp_path, value)
    assert plan_cli.main(ARGS + PAPER_FLAGS + ["--calibrate", path]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith(f"gridtron: --calibrate {path}: line 3 has step_time_s"), lines[0]


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_step_time_is_refused(tmp_path, text):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "step_time_s": 1.0}\n{"step": 2, "step_time_s": %s}\n' % text)
    with pytest.raises(ValueError, match="line 2 has step_time_s"):
        measured_step_time(str(path))


def test_null_step_time_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "step_time_s": 9.0}, {"step": 2, "step_time_s": 2.0},
            {"step": 3, "step_time_s": None}, {"step": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert measured_step_time(str(path)) == 2.0


def test_each_runs_first_step_is_left_out(tmp_path):
    """A run's records appended after records of another run that go on past its start (step 2
    after step 3), or a run started afresh (step 1): each run's first step is a warm-up, left out
    like the file's first; a record without a step continues the run before it."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "step_time_s": 9.0}, {"step": 2, "step_time_s": 2.0},
            {"step": 3, "step_time_s": 2.0},
            {"step": 2, "step_time_s": 9.0}, {"step": 3, "step_time_s": 1.0},
            {"step_time_s": 1.0}, {"step": 5, "step_time_s": 1.0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert measured_step_time(str(path)) == 1.0     # of 2, 2, 1, 1, 1
    rows += [{"step": 1, "step_time_s": 9.0}, {"step": 2, "step_time_s": 2.0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert measured_step_time(str(path)) == 1.5     # of 2, 2, 1, 1, 1, 2
