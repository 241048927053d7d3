"""Heartbeats through the job's store, so that a hung collective names who entered it and who not.

Every rank runs one light daemon thread that writes, about once a second, its communication
``Activity`` (parallel/runtime/comm.py: what the main thread records on every collective anyway) as
a small JSON value under ``gridtron/heartbeat/<rank>`` of the process group's TCP store::

    {"rank": 1, "t": 1718000000.3, "step": 12, "entered": {"dp": 40, "world": 25},
     "p2p": 96, "last": ["all_reduce", "dp", 40], "blocked": null}

The thread has a client connection of its own (a clone of the default store), only reads memory
the main thread writes, and issues no collective: a second thread's collectives would race with
training's on the same groups (and are illegal on NCCL/HCCL streams).

When a collective fails (the backend's timeout, ``--timeout-s``), ``describe`` reads the heartbeats
of the group's members and sorts them: members of a group enter the same sequence of collectives,
so a member whose count for that group kind is below the failed collective's number never entered
it. Each one is described by what it was doing: its step, the collective it is blocked in or "not
in a collective" (computing, or stuck in its own code), the last collective it entered, and whether
its heartbeat went silent (a dead or frozen process)::

    all_reduce #7 of the dp group (ranks [0, 1]): entered by rank 0; not entered by rank 1 (step 2,
    not in a collective, last entered all_reduce #5 of dp; heartbeat 0.4 s ago)

Where the host never sees the failure (NCCL/HCCL kill a process whose collective timed out from
their own watchdog), the heartbeat thread itself writes that description to stderr once the host
has been blocked in one collective for longer than the timeout (on gloo, whose calls raise, a little
later, so that the error of the main thread comes first).
"""
from __future__ import annotations

import atexit
import json
import sys
import threading
import time

from parallel.runtime.comm_monitor import group_kind

KEY = "gridtron/heartbeat/{}"


def _lane_text(key: str) -> str:
    """The lane of a counter key (comm_monitor.counter_key) in words: "" on the main lane,
    " on its dp-exchange lane" on a worker's own communicator."""
    kind = group_kind(key)
    return "" if kind == key else f" on its {key[len(kind) + 1:]} lane"


def _tag_text(tag) -> str:
    op, key, n = tag[:3]
    return f"{op} #{n} of {group_kind(key)}{_lane_text(key)}" if op != "p2p" else \
        f"point-to-point batch #{n} of {key}"


def peer_state(beat: dict | None, now: float, stale_s: float) -> str:
    """What one peer was doing, from its heartbeat."""
    if beat is None:
        return "no heartbeat: it never started one, or the store lost it"
    parts = [f"step {beat.get('step', 0)}"]
    blocked = beat.get("blocked")
    if blocked:
        parts.append(f"blocked in {_tag_text(blocked)} for {now - blocked[3]:.1f} s")
    else:
        parts.append("not in a collective")
    if beat.get("last"):
        parts.append(f"last entered {_tag_text(beat['last'])}")
    age = now - beat["t"]
    parts.append(f"heartbeat {age:.1f} s ago" + ("; silent since: dead or frozen" if age > stale_s else ""))
    return ", ".join(parts)


def describe_peers(tag, ranks, beats: dict, now: float, stale_s: float, limit: int = 8) -> str:
    """``tag`` = (op, kind, number) of this rank's failed collective over ``ranks``; ``beats``
    maps rank -> heartbeat dict (None when absent). Pure: sorts the members into those that
    entered that collective and those that did not."""
    op, kind, n = tag[:3]
    ranks = list(ranks)
    what = f"{op} #{n}" if op != "p2p" else f"point-to-point batch #{n}"
    if not ranks:  # no members to read: "all (or none) of them entered" would be a guess
        return (f"{what} of the {group_kind(kind)} group{_lane_text(kind)} (members unknown to "
                f"the heartbeat: who entered it cannot be told)")
    head = f"{what} of the {group_kind(kind)} group{_lane_text(kind)} (ranks {ranks if len(ranks) <= 16 else f'{len(ranks)} ranks'})"
    if op == "p2p":  # neighbours post different numbers of batches: describe them
        states = [f"rank {r} ({peer_state(beats.get(r), now, stale_s)})" for r in ranks[:limit]]
        return f"{head}: " + "; ".join(states)
    entered, missing = [], []
    for r in ranks:
        beat = beats.get(r)
        count = beat["entered"].get(kind, 0) if beat is not None else -1
        (entered if count >= n else missing).append(r)

    def listing(rs):
        shown = ", ".join(str(r) for r in rs[:16])
        return f"rank{'s' if len(rs) > 1 else ''} {shown}" + (f" and {len(rs) - 16} more" if len(rs) > 16 else "")
    text = f"{head}: entered by {listing(entered) if entered else 'no rank'}"
    if missing:
        described = [f"rank {r} ({peer_state(beats.get(r), now, stale_s)})" for r in missing[:limit]]
        more = f"; and {len(missing) - limit} more" if len(missing) > limit else ""
        text += "; not entered by " + "; ".join(described) + more
    else:
        text += "; every member entered it (a transfer failed, or a peer died inside it)"
    return text


class Heartbeat:
    """One rank's heartbeat thread and the reader of its peers' heartbeats."""

    def __init__(self, store, rank: int, activity, groups: dict[str, tuple], interval_s: float = 1.0,
                 watchdog_s: float | None = None, stream=None):
        """``groups``: this rank's group ranks by kind (to describe a collective the watchdog
        sees stuck); ``watchdog_s``: write a description once the host has been blocked in one
        collective this long (None: never)."""
        self.store, self.rank, self.activity = store, rank, activity
        self.groups, self.interval_s, self.watchdog_s = groups, interval_s, watchdog_s
        self.stream = stream or sys.stderr
        self.stale_s = 3 * interval_s + 1.0
        self._lock = threading.Lock()  # the store client is shared by the thread and describe()
        self._stop = threading.Event()
        self._reported = None
        self.failures = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"gridtron-heartbeat-{rank}")

    @classmethod
    def for_state(cls, ps, timeout_s: float, backend: str) -> "Heartbeat | None":
        """Started for ``ps`` on the default process group's store; None without one."""
        import torch.distributed as dist
        if ps.world_size == 1 or not dist.is_initialized():
            return None
        try:
            store = dist.distributed_c10d._get_default_store().clone()
        except (RuntimeError, AttributeError, ValueError):
            return None
        groups = cls.group_ranks(ps)
        interval = min(1.0, max(0.1, timeout_s / 10))
        # gloo's calls raise at the timeout themselves: give their error the first word
        watchdog = timeout_s if backend in ("nccl", "hccl") else timeout_s + 2 * interval + 1.0
        hb = cls(store, ps.rank, ps.comm.activity, groups, interval, watchdog)
        ps.comm.heartbeat = hb
        hb.start()
        return hb

    @staticmethod
    def group_ranks(ps) -> dict[str, tuple]:
        """The ranks of each of ``ps``'s groups by kind, the expert groups (ep, edp) included once
        ``init_expert_groups`` made them; a single-rank expert group is left out."""
        groups = {g.kind: g.ranks for g in (ps.tp_group, ps.cp_group, ps.pp_group, ps.dp_group,
                                            ps.dp_cp_group, ps.mp_group, ps.embedding_group,
                                            ps.world_group)}
        for g in (ps.ep_group, ps.edp_group):
            if g.size > 1:
                groups[g.kind] = g.ranks
        return groups

    # ---- writing --------------------------------------------------------------------------
    def payload(self) -> dict:
        a = self.activity
        return {"rank": self.rank, "t": time.time(), "step": a.step,
                "entered": {k: v for k, v in dict(a.entered).items() if v},
                "p2p": a.p2p, "last": a.last, "blocked": a.blocked}

    def beat(self) -> None:
        value = json.dumps(self.payload())
        with self._lock:
            self.store.set(KEY.format(self.rank), value)

    def start(self) -> None:
        self.beat()  # readable by the peers from the start
        self.thread.start()
        # A daemon thread still inside a store call when the interpreter finalises aborts the
        # process (SIGABRT): a trainer never closed is stopped at exit, before that happens.
        atexit.register(self.stop)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5 * self.interval_s + 10.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                self._watch()
            except Exception:  # noqa: BLE001 - the store may be gone with rank 0; keep quiet
                self.failures += 1

    def _watch(self) -> None:
        blocked = self.activity.blocked
        if self.watchdog_s is None or blocked is None or tuple(blocked[:3]) == self._reported:
            return
        waited = time.time() - blocked[3]
        if waited < self.watchdog_s:
            return
        self._reported = tuple(blocked[:3])
        ranks = self.groups.get(group_kind(blocked[1]), ())
        print(f"gridtron: rank {self.rank} has been blocked for {waited:.0f} s in "
              f"{self.describe(blocked, ranks)}", file=self.stream, flush=True)

    # ---- reading --------------------------------------------------------------------------
    def read(self, ranks) -> dict[int, dict | None]:
        out = {}
        with self._lock:
            for r in ranks:
                key = KEY.format(r)
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def describe(self, tag, ranks) -> str:
        """The failed collective ``tag`` of the group ``ranks``, with its members' states."""
        try:
            beats = self.read(ranks)
        except Exception as exc:  # noqa: BLE001 - e.g. the store's host (rank 0) is gone
            return f"{_tag_text(tag)} (group ranks {list(ranks)}): the peers' heartbeats are " \
                   f"unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        return describe_peers(tag, ranks, beats, time.time(), self.stale_s)
