"""The rendezvous before the process groups: every rank posts a digest of its configuration to the
job's TCP store, so that a rank that never comes, a rank that stopped on bad input or ranks
that disagree are named in one line on every rank before any collective."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from parallel.grid.launch import LaunchEnv, LayoutError


class RendezvousError(RuntimeError):
    """Ranks that did not reach the rendezvous within the timeout (the message names them)."""

    def __init__(self, message: str, arrived: tuple[int, ...] = ()):
        super().__init__(message)
        self.arrived = arrived  # the ranks that did arrive: the lowest of them reports it


class PeerStopped(LayoutError):
    """Another rank stopped on a configuration error before the process group existed; the
    lowest such rank (``rank``) reports ``message``, this one stops without a word."""

    def __init__(self, rank: int, message: str, meeting: "Rendezvous | None" = None):
        super().__init__(f"rank {rank} stopped: {message}")
        self.rank, self.message, self.meeting = rank, message, meeting


class Disagreement(LayoutError):
    """Ranks started with different configurations; every rank raises it and every rank reports it
    (engine/training/launch.py): each operator's log names the flags and ranks that differ."""

    def __init__(self, message: str, meeting: "Rendezvous | None" = None):
        super().__init__(message)
        self.meeting = meeting


RENDEZVOUS = "gridtron/rendezvous"
ATTEMPTS = "gridtron/attempts"  # in torchrun's agent store: one number per attempt, never reused
SHOWN_KEYS = 6  # differing keys a mismatch names per group of ranks
_ATTEMPT: dict[tuple[str, int, int], int] = {}  # this process's attempt, per store, rank and world


@dataclass
class Rendezvous:
    """The ranks' meeting on the rendezvous store before the first collective: every rank posts
    what it brings (a digest of its configuration, or the error it stopped on) and reads
    everyone's, so that a missing rank, a rank's configuration error and ranks started with
    different configurations are each named, on every rank, within the timeout, instead of a
    DistStoreError or a backend abort later. Each meeting has a namespace of its own (the n-th
    meeting of every rank is the same one).

    The store: the process group's when one exists, else torchrun's agent store, else a TCPStore
    at MASTER_ADDR:MASTER_PORT hosted by rank 0; ``init_process_group`` then runs on it. The
    agent store outlives the workers of an attempt (the rendezvous round's), so an attempt works
    under a prefix of its own, ``gridtron/attempt_N``, and never reads a dead attempt's keys. N is
    not TORCHELASTIC_RESTART_COUNT: each agent counts its own restarts (a restart for a node that
    joins does not count, a joining agent starts at 0), so the nodes of one round can disagree
    on it. Rank 0 takes a new N from the store and admits every other rank into it
    (``join_attempt``, ``Admission``); each process joins once.
    """
    store: object
    rank: int
    world_size: int
    timeout_s: float
    where: str
    hosts: bool = False  # this process serves the TCPStore: it leaves only once all have read
    deadline: float = 0.0
    name: str = RENDEZVOUS
    arrived: int = 0  # ranks whose entry the last exchange read
    attempt: int | None = None  # the agent store's attempt this process joined (None: no agent)
    admit: "Admission | None" = None  # rank 0, while the ranks of its attempt join

    @classmethod
    def open(cls, launch: LaunchEnv, timeout_s: float, env: dict | None = None) -> "Rendezvous":
        env = os.environ if env is None else env
        deadline = time.monotonic() + timeout_s
        if dist.is_initialized():
            store, where, hosts = dist.distributed_c10d._get_default_store(), "the process group's store", False
            agent = False  # (its keys lie under this attempt's prefix already)
        else:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise LayoutError(f"{launch.world_size} ranks meet at MASTER_ADDR:MASTER_PORT, and "
                                  f"they are not set: start the job with torchrun (or set both)")
            addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            where, hosts = f"{addr}:{port}", not agent and launch.rank == 0
            try:
                if not hosts:  # wait here, not in TCPStore, whose timeout logs C++ stacks
                    _wait_for_listener(addr, port, deadline)
                store = dist.TCPStore(addr, port, launch.world_size, is_master=hosts,
                                      timeout=datetime.timedelta(seconds=timeout_s),
                                      wait_for_workers=False)
            except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError
                host = "torchrun's agent" if agent else "rank 0"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RendezvousError(
                    f"rank {launch.rank} found no rendezvous store at {where} within --timeout-s "
                    f"{timeout_s:g} s: {host}, which serves it, did not arrive (or cannot listen "
                    f"there); start it, or raise --timeout-s [{first}]", (launch.rank,)) from exc
        attempt = admit = None
        if agent:
            key = (where, launch.rank, launch.world_size)
            attempt = _ATTEMPT.get(key)
            if attempt is None:
                attempt, admit = join_attempt(store, launch.rank, launch.world_size, deadline)
                if attempt is None:
                    raise RendezvousError(
                        f"rank 0 of {launch.world_size} did not arrive at the rendezvous ({where}) "
                        f"within --timeout-s {timeout_s:g} s: start it (or check its logs), or "
                        f"raise --timeout-s", (launch.rank,))
                _ATTEMPT[key] = attempt
            store = dist.PrefixStore(f"gridtron/attempt_{attempt}", store)
        call = store.add(f"{RENDEZVOUS}/calls/{launch.rank}", 1)
        return cls(store, launch.rank, launch.world_size, timeout_s, where, hosts, deadline,
                   f"{RENDEZVOUS}/{call}", attempt=attempt, admit=admit)

    def exchange(self, entry: dict, extra: str | None = None) -> dict[int, dict]:
        """Post ``entry`` (and ``extra``, read only on demand) and return every arrived rank's,
        waiting until all arrive or the deadline passes."""
        ns, store = self.name, self.store
        if extra is not None:
            store.set(f"{ns}/extra/{self.rank}", extra)
        store.set(f"{ns}/entry/{self.rank}", json.dumps(entry))
        store.add(f"{ns}/arrived", 1)
        delay = 0.005
        while store.add(f"{ns}/arrived", 0) < self.world_size and time.monotonic() < self.deadline:
            if self.admit is not None:  # the ranks still joining this attempt post once admitted
                self.admit()
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
        keys = [f"{ns}/entry/{r}" for r in range(self.world_size)]
        everyone = store.add(f"{ns}/arrived", 0) >= self.world_size
        present = list(range(self.world_size)) if everyone \
            else [r for r in range(self.world_size) if store.check([keys[r]])]
        values = store.multi_get([keys[r] for r in present])
        self.arrived = len(present)
        return {r: json.loads(bytes(v).decode()) for r, v in zip(present, values)}

    def extra(self, rank: int) -> str:
        return bytes(self.store.get(f"{self.name}/extra/{rank}")).decode()

    def leave(self, arrived: int | None = None) -> None:
        """Say this rank has read all it needs. Before a failed meeting ends the process
        (``arrived``: how many ranks came), the store's host waits, bounded by the timeout,
        until they all have."""
        count = self.store.add(f"{self.name}/read", 1)
        end = time.monotonic() + self.timeout_s
        while self.hosts and arrived is not None and count < arrived and time.monotonic() < end:
            time.sleep(0.01)
            count = self.store.add(f"{self.name}/read", 0)

    def stop(self, message: str) -> int:
        """Meet the others with the error this rank stopped on; returns the lowest rank that
        reported one (the one that prints it: once, not once per rank)."""
        entries = self.exchange({"error": message})
        self.leave(len(entries))
        return min(r for r, e in entries.items() if e.get("error"))

    def agree(self, agreement: dict[str, str] | None) -> None:
        """Meet every rank with this rank's ``agreement`` ({key: text} every rank must share, e.g.
        the resolved flags); raise RendezvousError (a rank missing), PeerStopped (a rank
        reported an error) or LayoutError (ranks disagree: the keys and ranks)."""
        text = None if agreement is None else json.dumps(agreement, sort_keys=True)
        mine = None if text is None else hashlib.sha256(text.encode()).hexdigest()
        entries = self.exchange({"digest": mine}, text)
        failed = sorted(r for r, e in entries.items() if e.get("error"))
        if failed:
            self.leave(len(entries))
            raise PeerStopped(failed[0], entries[failed[0]]["error"], self)
        if len(entries) < self.world_size:
            self.leave(len(entries))
            missing = sorted(set(range(self.world_size)) - set(entries))
            raise RendezvousError(
                f"{_ranks(missing)} of {self.world_size} did not arrive at the rendezvous "
                f"({self.where}) within --timeout-s {self.timeout_s:g} s: start {'it' if len(missing) == 1 else 'them'} "
                f"(or check {'its' if len(missing) == 1 else 'their'} logs), or raise --timeout-s",
                tuple(sorted(entries)))
        groups: dict[str | None, list[int]] = {}
        for r in sorted(entries):
            groups.setdefault(entries[r]["digest"], []).append(r)
        if len(groups) > 1:
            message = self._disagreement(groups, entries[0]["digest"])
            self.leave(len(entries))
            raise Disagreement(message, self)
        self.leave()

    def _disagreement(self, groups: dict, reference: str | None) -> str:
        base = json.loads(self.extra(0)) if reference is not None else {}
        parts = []
        for digest, ranks in list(groups.items())[1:4]:
            theirs = json.loads(self.extra(ranks[0])) if digest is not None else {}
            keys = sorted(k for k in base.keys() | theirs.keys() if base.get(k) != theirs.get(k))
            shown = ", ".join(f"{k} {_value(theirs.get(k))} (rank 0: {_value(base.get(k))})"
                              for k in keys[:SHOWN_KEYS])
            more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
            parts.append(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {shown}{more}")
        others = len(groups) - 4
        tail = f"; {others} more groups of ranks differ too" if others > 0 else ""
        return (f"ranks started with different configurations: {'; '.join(parts)}{tail}; start "
                f"every rank with the same flags and recipe")


class Admission:
    """Rank 0's side of ``join_attempt``: admits into ``attempt`` each rank's latest join request
    (one it finds from a dead attempt is admitted too, and read by no one); the ranks are read
    again only once the count of all requests has moved."""

    def __init__(self, store, attempt: int, world_size: int):
        self.store, self.attempt, self.world_size = store, attempt, world_size
        self.served: dict[int, int] = {}
        self.requests = -1

    def __call__(self) -> None:
        requests = self.store.add(f"{ATTEMPTS}/requests", 0)
        if requests == self.requests:
            return
        self.requests = requests
        for rank in range(1, self.world_size):
            request = self.store.add(f"{ATTEMPTS}/join/{rank}", 0)
            if request and self.served.get(rank) != request:
                self.store.set(f"{ATTEMPTS}/join/{rank}/{request}", str(self.attempt))
                self.served[rank] = request


def join_attempt(store, rank: int, world_size: int, deadline: float) -> tuple[int | None, Admission | None]:
    """The attempt number every rank of this attempt shares on torchrun's agent store, which
    keeps the keys of earlier attempts: rank 0 takes a new one (and returns the ``Admission``
    that it serves while it waits for the others); any other rank asks under a request number
    of its own (one more than any earlier process of its rank asked) and waits, up to
    ``deadline``, for rank 0's answer to that request (None: none came). A stale answer never
    matches a new request, and an attempt number is never reused."""
    if rank == 0:
        attempt = store.add(ATTEMPTS, 1)
        admit = Admission(store, attempt, world_size)
        admit()
        return attempt, admit
    key = f"{ATTEMPTS}/join/{rank}/{store.add(f'{ATTEMPTS}/join/{rank}', 1)}"
    store.add(f"{ATTEMPTS}/requests", 1)  # after its own: rank 0 then reads it
    delay = 0.005
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return None, None
        time.sleep(delay)
        delay = min(2 * delay, 0.2)
    return int(bytes(store.get(key)).decode()), None


def _wait_for_listener(addr: str, port: int, deadline: float) -> None:
    """Return once something listens at addr:port; TimeoutError at ``deadline``."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.05)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _value(text: str | None) -> str:
    if text is None:
        return "(unset)"
    value = json.loads(text)
    return value if isinstance(value, str) else text
