"""A pool of worker processes, one per rank, that train case after case under the stream checker.

Starting a rank costs seconds (importing torch and the engine), more than a small case trains, so
the fuzzer starts ``world`` processes once and hands every case of that world size to all of them
(``rank_context``: forked from one server process that imported the engine once, where the platform
has one):
each case is one ``Trainer`` per rank (a process group of its own, on a fresh rendezvous port,
destroyed when the case ends), trained under a fresh ``StreamChecker``. A rank's result is its
losses, gradient norms and violations, or its error; a case that has not finished within the
deadline ends the pool (its ranks are killed) and is reported as hung.
"""
from __future__ import annotations

import gc
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


P2P = ("send", "recv")

# What a rank imports before its first job. torch.optim imports Dynamo at a model's first parameter
# group, so every rank that trains pays for it: imported once in the server instead of per rank.
PRELOAD = ("torch", "torch._dynamo", "engine.config.cli", "engine.training.trainer",
           "parallel.runtime.stream_check", "engine.fuzz.pool")


def rank_context(preload: tuple[str, ...] = ()):
    """The multiprocessing context that starts rank processes: ``forkserver`` where the platform
    has it (Linux, macOS), whose server imports ``PRELOAD`` (and ``preload``) once and forks each
    rank from that state, so a rank starts in milliseconds instead of the ~4 CPU-seconds of
    importing torch and the engine; ``spawn`` elsewhere. The server is one per process and holds
    no device context, process group or thread of the caller's (it only imported modules), which
    is what makes forking from it safe where forking the caller is not; the first call's preload
    list is the one it keeps."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD + preload))
    return ctx


def train_checked(argv: list[str]) -> dict:
    """One rank of one case: the trainer under the stream-order checker, with the sequence of
    collectives it submitted to each communicator (parallel/runtime/lanes.py ``order_mismatch``)."""
    from engine.config.cli import parse_args
    from engine.fuzz.compare import figures
    from engine.training.trainer import Trainer
    from parallel.runtime.stream_check import StreamChecker
    checker, order = StreamChecker(), []

    def record(event) -> None:
        if event.op not in P2P:
            order.append(((event.group, event.lane, tuple(event.ranks)), event.op))

    with checker.installed():
        trainer = Trainer(parse_args(argv))
        trainer.ps.comm.observers.append(record)
        try:
            result = trainer.train()
        finally:
            trainer.close()
    return {**figures(result), "violations": list(checker.violations), "order": order}


def quiet() -> None:
    """Send this process's output (prints, warnings, the backends' own logs) to /dev/null: the
    fuzzer prints one line per case."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)


def _worker(rank: int, world: int, jobs, results, setup) -> None:
    import torch
    torch.set_num_threads(1)
    quiet()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if setup is not None:
        setup()
    while True:
        job = jobs.get()
        if job is None:
            return
        index, port, argv = job
        os.environ["MASTER_PORT"] = str(port)
        try:
            out = train_checked(argv)
        except BaseException:  # noqa: BLE001 - reported to the parent, which ends the pool
            out = {"error": traceback.format_exc(limit=12)}
        gc.collect()  # the trainer's process groups sit in reference cycles: free their threads now
        results.put((index, rank, out))
        if "error" in out:
            return  # peers of a failed rank are stuck in a collective: the pool is done


class Pool:
    """``world`` ranks; ``run(index, argv, deadline_s)`` trains one case on all of them.
    ``setup``: a module-level function every rank calls once at start (tests plant defects
    with it)."""

    def __init__(self, world: int, setup=None):
        ctx = rank_context()
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.jobs[r], self.results, setup),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, index: int, argv: list[str], deadline_s: float) -> list[dict]:
        """Every rank's result, in rank order; a rank that did not answer gets ``{"error": ...}``
        (and the pool is broken: ``close`` it and start another)."""
        port = free_port()
        for q in self.jobs:
            q.put((index, port, argv))
        out: dict[int, dict] = {}
        end = time.monotonic() + deadline_s
        while len(out) < self.world:
            try:
                i, rank, result = self.results.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in out]
                if time.monotonic() > end or dead:
                    why = f"exited with code {self.procs[dead[0]].exitcode}" if dead else \
                        "stopped in a collective with a failed peer" if self.broken else \
                        f"did not finish within {deadline_s:g} s"
                    for r in range(self.world):
                        out.setdefault(r, {"error": f"rank {r} {why}"})
                    self.broken = True
                    break
                continue
            if i == index:
                out[rank] = result
                if "error" in result and not self.broken:  # its peers fail on their timeout;
                    self.broken = True                     # give them a moment to say why
                    end = min(end, time.monotonic() + 10.0)
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive() and not self.broken:
                q.put(None)
        for p in self.procs:
            p.join(timeout=5 if not self.broken else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
