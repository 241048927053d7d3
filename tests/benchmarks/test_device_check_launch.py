"""How the device check runs a stage's command (benchmarks/device_check/launch.py): forked from
a preloaded server on the CPU, a fresh process otherwise; both give the command's exit code, its
output in the log, the caller's environment, and stop it and every process descended from it at
the deadline (torchrun's workers, in sessions of their own, included)."""
from __future__ import annotations

import os
import signal
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


def _gone(pid: int) -> bool:
    """Whether ``pid`` ended within 5 s (killed and not yet reaped counts as ended)."""
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("run", [run_forked, run_process], ids=["forked", "fresh"])
def test_the_deadline_stops_the_command_and_its_children(run, tmp_path):
    start = time.monotonic()
    code, wall = run(PROBE + [str(tmp_path), "0", "child", "sleep"], tmp_path / "probe.log", 8.0)
    assert code is None and 8.0 <= wall < 30 and time.monotonic() - start < 30
    child = int((tmp_path / "child.pid").read_text())
    assert _gone(child), f"the stage's child {child} outlived the deadline"


@pytest.mark.parametrize("run", [run_forked, run_process], ids=["forked", "fresh"])
def test_the_deadline_stops_a_child_in_a_session_of_its_own(run, tmp_path):
    """A child outside the command's process group (torchrun's workers are) is stopped too."""
    code, _ = run(PROBE + [str(tmp_path), "0", "child", "session", "sleep"], tmp_path / "probe.log", 3.0)
    child = int((tmp_path / "child.pid").read_text())
    try:
        assert code is None and _gone(child), f"the stage's child {child} outlived the deadline"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_the_deadline_stops_torchrun_workers(tmp_path):
    """torchrun (the command two_ranks and tp_overlap launch on a device) starts each worker in a
    session of its own: none may outlive the deadline."""
    body = (f"import os, time; open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w')"
            f".write(str(os.getpid())); time.sleep(60)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "timeit", "-n", "1", body]
    code, _ = run_process(cmd, tmp_path / "log", 12.0)
    workers = [int(f.read_text()) for f in sorted(tmp_path.glob("rank*"))]
    left = [pid for pid in workers if not _gone(pid)]
    for pid in left:  # what the deadline left behind
        os.kill(pid, signal.SIGKILL)
    assert code is None and len(workers) == 2, (code, workers, (tmp_path / "log").read_text())
    assert left == [], f"workers left running after the deadline: {left}"


def test_non_module_commands_start_fresh(tmp_path):
    code, _ = run_forked([sys.executable, "-c", "import sys; print('plain'); sys.exit(4)"],
                         tmp_path / "plain.log", 60.0)
    assert code == 4 and (tmp_path / "plain.log").read_text() == "plain\n"
