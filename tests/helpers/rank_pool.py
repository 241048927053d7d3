"""Rank processes started once per world size and handed one job after another.

Starting a rank costs seconds of CPU (importing torch and the engine) and the suite asks for
groups of the same sizes over a hundred times, so ``run_distributed`` keeps ``world_size`` rank
processes per size (forked from a server that imported the engine once: ``engine.fuzz.pool.
rank_context``) and sends each call to them: every job builds its own process groups on a fresh
rendezvous port and destroys them when it ends, exactly as a freshly spawned rank would.

What a fresh process would have, each job gets again: the parent's environment, working
directory and ``sys.path`` as they are at the call (a test's ``monkeypatch.setenv`` reaches its
ranks), torch's default generator at its start-up seed, fp32 as the default dtype, gradients on,
and Dynamo's caches cleared (a compiled test does not inherit another's graphs or recompile
limit). After each job the garbage collector runs: a trainer's process groups live in reference
cycles, and their gloo threads would otherwise pile up job after job. Patches a job makes to modules must be undone by the job (the suite's checks do so in
``finally`` blocks or ``mock.patch`` contexts).

A job that fails ends its ranks: the failed rank writes its error and exits (its peers would be
stuck in a collective), and the parent kills the whole pool, which the next call starts anew; so
does a job past its deadline.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import sys
import time
from multiprocessing.connection import wait

import torch

from engine.fuzz.pool import rank_context


def _reset(seed: int) -> None:
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _threads() -> int:
    """This process's threads (Linux; 0 elsewhere)."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _serve(rank: int, world_size: int, conn) -> None:
    from engine.training.launch import exit_now
    torch.set_num_threads(1)
    seed = torch.initial_seed()
    while True:
        message = conn.recv()
        if message is None:
            exit_now(0)
        env, cwd, path, payload = message
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        _reset(seed)
        target, job = pickle.loads(payload)
        fault = open(os.path.join(job[4], f"{rank}.fault"), "w")  # noqa: SIM115 - closed below
        faulthandler.enable(fault, all_threads=True)
        target(rank, world_size, *job)  # a failure exits this process
        # the job's trainers hold their process groups in reference cycles: collected here, or
        # each job would leave its gloo threads running (hundreds after a few dozen jobs)
        gc.collect()
        faulthandler.disable()
        fault.close()
        conn.send((rank, _threads()))


MAX_THREADS = 40  # a rank with more threads than this after a job is replaced (at rest: ~17)


class RankPool:
    """``world_size`` spawned ranks serving ``run`` calls one at a time."""

    def __init__(self, world_size: int):
        ctx = rank_context(("tests.helpers.rank_pool", "tests.helpers.dist_utils"))
        self.world_size, self.conns, self.procs = world_size, [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, target, job: tuple, deadline_s: float) -> str | None:
        """Run ``target(rank, world_size, *job)`` on every rank; ``None`` when every rank finished,
        else why not (the pool is then closed: its ranks were killed)."""
        payload = pickle.dumps((target, job))
        message = (dict(os.environ), os.getcwd(), list(sys.path), payload)
        for conn in self.conns:
            conn.send(message)
        done, threads, exited, end = set(), 0, False, time.monotonic() + deadline_s
        while len(done) < self.world_size:
            left = end - time.monotonic()
            if left <= 0:
                self.close()
                return "deadline"
            ready = wait([c for r, c in enumerate(self.conns) if r not in done] +
                         [p.sentinel for r, p in enumerate(self.procs) if r not in done],
                         timeout=min(left, 5.0))
            for rank, conn in enumerate(self.conns):
                if conn in ready and rank not in done:
                    try:
                        rank_done, count = conn.recv()
                    except EOFError:
                        continue
                    done.add(rank_done)
                    threads = max(threads, count)
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in done]
            left_ok = [r for r in dead if self.procs[r].exitcode == 0]
            done.update(left_ok)     # a job may end its rank with exit code 0 (a vanished peer):
            exited |= bool(left_ok)  # finished, as a freshly spawned rank would be
            failed = [r for r in dead if r not in left_ok]
            if failed:
                self.close()
                return f"process {failed[0]} terminated with exit code {self.procs[failed[0]].exitcode}"
        if exited or threads > MAX_THREADS:  # a rank is gone, or a job left threads: start afresh
            self.close()
        return None

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                proc.kill()
            proc.join(10)
            conn.close()


_POOLS: dict[int, RankPool] = {}


def pool(world_size: int) -> RankPool:
    """The live pool of ``world_size`` ranks, started when there is none."""
    current = _POOLS.get(world_size)
    if current is None or not current.alive:
        current = _POOLS[world_size] = RankPool(world_size)
    return current


def close_all() -> None:
    for current in _POOLS.values():
        for conn, proc in zip(current.conns, current.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        current.close()
    _POOLS.clear()
