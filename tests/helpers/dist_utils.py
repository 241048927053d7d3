"""Run a function on N real gloo ranks on this CPU and collect what each rank returns.

    results = run_distributed(check_fn, world_size=4, grid=RankGrid(tp=2, dp=2), args=(...))

``check_fn(ps, *args)`` must be a module-level function (it is pickled into spawned processes);
``results[rank]`` is its return value. An exception on any rank fails the call with that rank's
traceback; a rank that has not finished within ``deadline_s`` (a hang) fails it too, naming the
ranks still running, and every rank is killed. The ranks are processes spawned once per world
size and reused from call to call, each call in fresh process groups (tests/helpers/rank_pool.py);
still, do many checks per call: building the groups costs time too.

Every collective runs under the backend rules named by ``GRIDTRON_BACKEND_RULES`` (tests/conftest.py
sets "hccl" for the whole suite, read here once): gloo executes the collectives, and anything HCCL
would refuse (a float64 reduction, ``gather``, ...) fails the test. ``backend_rules=`` overrides it.
"""
from __future__ import annotations

import atexit
import os
import tempfile
import traceback

import torch

from engine.fuzz.pool import free_port
from engine.training.launch import exit_now
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers import rank_pool

SUITE_RULES = os.environ.get("GRIDTRON_BACKEND_RULES") or None
atexit.register(rank_pool.close_all)


def _job(rank, world_size, port, grid, fn, args, out_dir, timeout_s, rules):
    """One rank of one call, in a pool process (tests/helpers/rank_pool.py): ``fn``'s result in
    ``out_dir/<rank>.pt``, or its error there and this process gone (its peers are stuck)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    ps = None
    try:
        # with the exchange worker's DP group, so that any check can build a compressed reducer
        ps = ParallelState.initialize(grid, torch.device("cpu"), "gloo",
                                      LaunchEnv.from_env(), timeout_s=timeout_s, backend_rules=rules,
                                      dp_exchange=True)
        result = fn(ps, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported to the parent
        torch.save({"ok": False, "error": traceback.format_exc()},
                   os.path.join(out_dir, f"{rank}.pt"))
        exit_now(1)  # a failed rank ends the job; the parent kills its peers
    ps.destroy()


DEADLINE_S = 900.0  # a group still running after this long is hung


def run_distributed(fn, world_size: int | None = None, grid: RankGrid | None = None,
                    args: tuple = (), timeout_s: float = 120.0, backend_rules: str | None = "suite",
                    deadline_s: float = DEADLINE_S, vanishes: bool = False) -> list:
    """``timeout_s``: the process groups' collective timeout; ``deadline_s``: the whole call's.
    A rank that ends without a result (exit code 0, no error) fails the call unless ``vanishes``
    says the job ends some rank that way on purpose (its entry is then None)."""
    grid = grid or RankGrid(dp=world_size)
    rules = SUITE_RULES if backend_rules == "suite" else backend_rules
    world_size = grid.world_size
    with tempfile.TemporaryDirectory() as out_dir:
        why = rank_pool.pool(world_size).run(
            _job, (free_port(), grid, fn, args, out_dir, timeout_s, rules), deadline_s)
        failure = None
        if why == "deadline":
            hung = [r for r in range(world_size) if not os.path.exists(os.path.join(out_dir, f"{r}.pt"))]
            failure = TimeoutError(f"rank(s) {hung or 'all'} still running after {deadline_s:g} s "
                                   f"(a hang): every rank was killed")
        elif why is not None:
            failure = why
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                if not vanishes and failure is None:
                    errors.append(f"--- rank {rank} ---\nended without a result or an error")
                results.append(None)
                continue
            data = torch.load(path, weights_only=False)
            if data["ok"]:
                results.append(data["result"])
            else:
                errors.append(f"--- rank {rank} ---\n{data['error']}")
                results.append(None)
        for rank in range(world_size):
            fault = os.path.join(out_dir, f"{rank}.fault")
            if os.path.exists(fault) and os.path.getsize(fault):
                with open(fault) as f:
                    errors.append(f"--- rank {rank}: native crash, every thread's stack ---\n{f.read()}")
        if errors or failure is not None:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors) + f"\n{failure or ''}")
        return results


def gather_tensors(group, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (equal shapes) from a CommGroup, in group order (one all-gather)."""
    out = torch.empty((group.size, *t.shape), dtype=t.dtype, device=t.device)
    group.all_gather_into(out.view(group.size * t.shape[0] if t.dim() else group.size, *t.shape[1:]),
                          t.contiguous())
    return list(out.unbind(0))


class record_comm:
    """Context manager: every CommEvent issued through ``ps``'s groups while inside, in order."""

    def __init__(self, ps):
        self.ps, self.events = ps, []

    def __enter__(self):
        self.ps.comm.observers.append(self.events.append)
        return self.events

    def __exit__(self, *exc):
        self.ps.comm.observers.remove(self.events.append)
        return False
