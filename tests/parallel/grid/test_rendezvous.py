"""The rendezvous on torchrun's agent store, which outlives each attempt's workers: the ranks of one
attempt meet under one prefix whatever TORCHELASTIC_RESTART_COUNT their agents give them (each
agent counts its own restarts: a restart for a node that joins does not count, and a joining
agent starts at 0), and no attempt reads an earlier one's keys. Each rank is a thread here, with
its agent's environment, on a TCPStore served by the test as the agent would."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

import parallel.grid.rendezvous as rendezvous
from parallel.grid.launch import LaunchEnv
from parallel.grid.rendezvous import Rendezvous, RendezvousError


@pytest.fixture()
def agent_store(monkeypatch):
    monkeypatch.setattr(rendezvous, "_ATTEMPT", {})
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def _attempt(port: int, restarts: list[int], flags: str, timeout_s: float = 10.0,
             first: int | None = None) -> dict:
    """One attempt's workers (new processes: none has joined an attempt yet), rank r under an
    agent whose restart count is ``restarts[r]``, agreeing on ``flags``; rank ``first`` starts
    0.3 s before the others. Returns rank -> (attempt, meeting name), or the error it raised."""
    rendezvous._ATTEMPT.clear()
    n, out = len(restarts), {}

    def worker(rank):
        if first is not None and rank != first:
            time.sleep(0.3)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "job",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(restarts[rank])}
        try:
            meeting = Rendezvous.open(LaunchEnv(rank, n, rank % 2, 2), timeout_s, env)
            meeting.agree({"flags": flags})
            out[rank] = (meeting.attempt, meeting.name)
        except Exception as exc:  # noqa: BLE001 - compared below
            out[rank] = exc

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_agents_with_other_restart_counts_meet_and_attempts_never_collide(agent_store):
    port = agent_store.port
    # the first attempt: two nodes (ranks 0-1, 2-3), no restart yet
    a = _attempt(port, [0, 0, 0, 0], "A")
    # node 1's worker failed: its agent restarted (count 1); node 0's agent restarted for the
    # membership change, which counts nothing (count 0); node 1's ranks ask before rank 0 exists
    b = _attempt(port, [0, 0, 1, 1], "B", first=3)
    # a new node joins (its agent starts at 0) beside node 0, which had failed since (count 1)
    c = _attempt(port, [1, 1, 0, 0, 0, 0], "C", first=5)
    for attempt in (a, b, c):
        assert all(isinstance(v, tuple) for v in attempt.values()), attempt
        assert len(set(attempt.values())) == 1, attempt   # one attempt, one meeting
    assert len({a[0][0], b[0][0], c[0][0]}) == 3   # no attempt reads another's keys
    # each process joins its attempt once: a second meeting (a rank that stopped, say) follows
    again = Rendezvous.open(LaunchEnv(0, 6, 0, 2), 1.0, {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert again.attempt == c[0][0] and again.name != c[0][1] and again.admit is None


def test_a_missing_rank_0_is_named(agent_store):
    """Rank 1 waits for rank 0's answer up to --timeout-s, then names it, as a missing rank is."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent_store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RendezvousError, match=r"^rank 0 of 2 did not arrive at the rendezvous "
                                              r"\(127\.0\.0\.1:\d+\) within --timeout-s 0\.5 s") as err:
        Rendezvous.open(LaunchEnv(1, 2, 1, 2), 0.5, env).agree({"flags": "A"})
    assert err.value.arrived == (1,)
