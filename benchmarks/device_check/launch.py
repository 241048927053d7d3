"""Running a stage's command under its deadline: a fresh process on a device, a fork of a
preloaded server on the CPU.

``launcher(kind)`` is what every stage runs its commands with, ``(cmd, log_path, deadline_s) ->
(exit code, or None when stopped at the deadline, wall seconds)``; output goes to ``log_path``
and at the deadline the command and every process descended from it are stopped
(``stop_tree``): torchrun starts each worker in a session of its own, so stopping the command's
process group alone would leave the workers running, holding device memory while the next
stages run.

- ``run_process`` (on a device, and every command that is not ``python -m <module>``): a fresh
  interpreter per command. Nothing of the check's own process or of an earlier stage (an
  import, a device context, a cache) reaches the stage that is measured.
- ``run_forked`` (``kind`` "cpu": the tiny plan the tests run): a ``python -m <module>`` command
  (torchrun's included: its agent, not its workers) runs as ``runpy`` would run it, in a process
  forked from a server that imported torch and the engine once (``engine.fuzz.pool.rank_context``,
  the test suite's and the fuzzer's ranks come from the same kind of server). A fresh
  interpreter spends about 3 of a tiny stage's 3.5 CPU seconds importing; a fork starts in
  milliseconds. The child gets the caller's environment, the repository as its working
  directory, its own session, its output in the log, and its ``atexit`` handlers run before it
  exits, as an interpreter's would. The server holds no device context, so the fork is as safe as torch's own
  forkserver workers; it is kept to the CPU all the same, where no stage measures a device.
"""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import REPO


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _children() -> dict[int, list[int]]:
    """parent pid -> its children's pids, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def descendants(pid: int) -> set[int]:
    """Every process descended from ``pid`` (children, their children, ...), now."""
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def stop_tree(pid: int) -> None:
    """Kill ``pid``, every process descended from it and the process groups they lead (what
    left the tree but stayed in such a group). The tree is stopped first (SIGSTOP) until no new
    process appears, so nothing forks or is re-parented away between finding the tree and
    killing it."""
    tree: set[int] = set()
    for _ in range(20):
        new = ({pid} | descendants(pid)) - tree
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        tree |= new
    for p in tree:
        try:
            group = os.getpgid(p)
            if group in tree:   # a group one of them leads (never the caller's, nor a server's)
                os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_process(cmd: list[str], log_path: Path, deadline_s: float) -> tuple[int | None, float]:
    """``cmd`` as a fresh process: (exit code or None when stopped at the deadline, wall
    seconds); at the deadline it and all its descendants are stopped (``stop_tree``)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            stop_tree(proc.pid)
            proc.wait()
            code = None
    return code, time.monotonic() - start


def _exit_code(code) -> int:
    """A ``SystemExit`` argument as the exit status an interpreter gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_module(module: str, argv: list[str], log_path: str, env: dict, cwd: str) -> None:
    """The forked child: ``python -m module *argv`` with its output in ``log_path``."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - an interpreter prints it and exits 1
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_forked(cmd: list[str], log_path: Path, deadline_s: float) -> tuple[int | None, float]:
    """``[python, "-m", module, *argv]`` forked from the preloaded server (module docstring);
    any other command by ``run_process``."""
    if cmd[1:2] != ["-m"]:
        return run_process(cmd, log_path, deadline_s)
    from engine.fuzz.pool import rank_context
    start = time.monotonic()
    proc = rank_context().Process(target=_run_module,
                                  args=(cmd[2], cmd[3:], str(log_path), _env(), str(REPO)))
    proc.start()
    proc.join(deadline_s)
    code = proc.exitcode
    if code is None:  # past the deadline: the child and whatever it started
        stop_tree(proc.pid)
        proc.join()
    return code, time.monotonic() - start


def launcher(kind: str):
    """How the stages of a check on device ``kind`` run their commands (module docstring)."""
    return run_forked if kind == "cpu" else run_process
