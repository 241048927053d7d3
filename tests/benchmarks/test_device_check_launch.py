"""How the device check runs a stage's command (benchmarks/device_check/launch.py): forked from
a preloaded server on the CPU, a fresh process otherwise; both give the command's exit code, its
output in the log, the caller's environment, and stop it and its children at the deadline."""
from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks.device_check.launch import REPO, launcher, run_forked, run_process

PROBE = [sys.executable, "-m", "tests.helpers.stage_probe"]


def test_the_cpu_forks_and_a_device_starts_fresh_processes():
    assert launcher("cpu") is run_forked
    assert launcher("cuda") is run_process and launcher("npu") is run_process


@pytest.mark.parametrize("run", [run_forked, run_process], ids=["forked", "fresh"])
def test_exit_code_output_environment_and_atexit(run, tmp_path, monkeypatch):
    monkeypatch.setenv("STAGE_PROBE", "seen")
    log = tmp_path / "probe.log"
    code, wall = run(PROBE + [str(tmp_path), "3", "x"], log, 60.0)
    assert code == 3 and 0 < wall < 60
    lines = log.read_text().splitlines()
    assert lines == [f"argv ['3', 'x'] cwd {REPO} probe seen main __main__", "to stderr"], lines
    assert (tmp_path / "atexit").exists()  # the handlers an interpreter runs at exit


@pytest.mark.parametrize("run", [run_forked, run_process], ids=["forked", "fresh"])
def test_the_deadline_stops_the_command_and_its_children(run, tmp_path):
    start = time.monotonic()
    code, wall = run(PROBE + [str(tmp_path), "0", "child", "sleep"], tmp_path / "probe.log", 8.0)
    assert code is None and 8.0 <= wall < 30 and time.monotonic() - start < 30
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):  # the child was killed with its session; gone once its parent reaps it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # killed, not yet reaped
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stage's child {child} outlived the deadline")


def test_non_module_commands_start_fresh(tmp_path):
    code, _ = run_forked([sys.executable, "-c", "import sys; print('plain'); sys.exit(4)"],
                         tmp_path / "plain.log", 60.0)
    assert code == 4 and (tmp_path / "plain.log").read_text() == "plain\n"
