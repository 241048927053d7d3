"""What a rank's collectives are counted and tracked by: the group kinds, the ring-model wire
bytes, one ``CommEvent`` per call, the per-kind counters and observers (``CommMonitor``, shared
by the groups of one ParallelState), this rank's ``Activity`` (what it entered, what it is blocked
in: the heartbeat and the straggler report read it) and the handle of an asynchronous collective
(``TrackedWork``). ``parallel.runtime.comm`` issues the collectives and fills these in.

>>> wire_bytes("all_reduce", 1000, 4), wire_bytes("all_gather", 250, 4), wire_bytes("send", 8, 2)
(1500, 750, 8)
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from parallel.runtime import streams
from parallel.runtime.backend_rules import get_rules
from parallel.runtime.lanes import MAIN_LANE

GROUP_KINDS = ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding", "world", "ep", "edp")


def wire_bytes(op: str, nbytes: int, size: int) -> int:
    """Ring-model bytes one rank sends for ``op`` handed ``nbytes`` on ``size`` ranks."""
    if size <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (size - 1) * nbytes // size
    if op in ("reduce_scatter", "all_to_all", "broadcast"):
        return (size - 1) * nbytes // size
    if op == "all_gather":
        return (size - 1) * nbytes
    if op == "send":
        return nbytes
    return 0


@dataclass(frozen=True)
class CommEvent:
    """One collective as issued by this rank."""
    op: str                 # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, barrier, object
    group: str              # group kind
    ranks: tuple            # global ranks of the group
    dtype: str | None
    payload_bytes: int
    wire_bytes: int
    async_op: bool = False
    received_bytes: int = 0  # what a recv lands (its payload is 0: traffic counts what is sent)
    lane: str = MAIN_LANE    # the group's lane (lanes.py): a worker's own communicator


@dataclass
class Counter:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0


def counter_key(kind: str, lane: str) -> str:
    """What a collective of group kind ``kind`` issued on ``lane`` is counted and tagged under:
    ``kind`` on the main lane, ``kind@lane`` on a worker's own communicator.

    >>> counter_key("dp", "main"), counter_key("dp", "dp-exchange")
    ('dp', 'dp@dp-exchange')
    """
    return kind if lane == MAIN_LANE else f"{kind}@{lane}"


def group_kind(key: str) -> str:
    """The group kind of a counter key (``counter_key``): ``group_kind("dp@dp-exchange") == "dp"``."""
    return key.split("@", 1)[0]


@dataclass
class Activity:
    """What this rank's communication is doing; cheap to update, read by other threads.

    ``entered[kind]`` counts the collectives this rank has entered on its group of that kind (every
    member of a group enters the same sequence, so collective #n of a group is the same operation on
    every member); a worker's own communicator of that kind (a lane other than the main one,
    lanes.py) is counted apart, under ``kind@lane`` (``counter_key``), since the two lanes'
    collectives interleave differently on different ranks; point-to-point batches are counted apart in ``p2p`` (neighbours post different
    numbers of them). ``last`` is the (op, kind, number) entered last, ``blocked`` the (op, kind,
    number, wall time) the host is waiting in now (None while it computes), ``failed`` the one whose
    call or wait raised. With a ``clock`` (anything with ``stamp()``, e.g.
    parallel.pipeline.executor.HostClock or a device clock) every blocked interval is appended to
    ``spans`` as (kind, start, end) stamps; the reader empties the list. ``watched``: group kinds
    whose blocked intervals are also appended, as (start, end) stamps of ``watch_clock``, to
    ``watched[kind]`` (the step's exposed TP time, engine/training/step.py; the step empties them),
    with or without ``clock``. ``step`` is set by the training loop."""
    entered: dict = field(default_factory=lambda: {k: 0 for k in GROUP_KINDS})
    p2p: int = 0
    last: tuple | None = None
    blocked: tuple | None = None
    failed: tuple | None = None
    clock: object = None
    spans: list = field(default_factory=list)
    watched: dict = field(default_factory=dict)
    watch_clock: object = None
    step: int = 0

    def enter(self, op: str, kind: str, lane: str = MAIN_LANE) -> tuple:
        if op in ("send", "recv", "p2p"):
            self.p2p += 1
            tag = ("p2p", kind, self.p2p)
        else:
            key = counter_key(kind, lane)
            self.entered[key] = self.entered.get(key, 0) + 1
            tag = (op, key, self.entered[key])
        self.last = tag
        return tag

    def block(self, tag: tuple, fn: Callable, /, *args, **kwargs):
        """Run ``fn`` (a collective call or a wait) as time blocked in ``tag``."""
        clock = self.clock
        start = clock.stamp() if clock is not None else None
        watch = self.watched.get(tag[1]) if self.watched else None
        w_start = self.watch_clock.stamp() if watch is not None else None
        self.blocked = (*tag, time.time())
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.failed = tag
            raise
        finally:
            self.blocked = None
            if watch is not None:
                watch.append((w_start, self.watch_clock.stamp()))
            if start is not None:
                self.spans.append((tag[1], start, clock.stamp()))


class TrackedWork:
    """The handle of an asynchronous collective: ``wait()`` counts as blocked time of its
    collective; everything else is the torch.distributed handle's."""
    __slots__ = ("work", "activity", "tag", "access")

    def __init__(self, work, activity: Activity, tag: tuple, access=None):
        self.work, self.activity, self.tag = work, activity, tag
        self.access = access  # the stream-order checker's record of it (streams.py)

    def wait(self, *args, **kwargs):
        if self.access is None and not streams.checking():
            return self.activity.block(self.tag, self.work.wait, *args, **kwargs)
        with streams.collective_call():
            result = self.activity.block(self.tag, self.work.wait, *args, **kwargs)
        streams.collective_waited(self.access)
        return result

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        if done:  # the host saw it finish: what it issues next is ordered after the collective
            streams.collective_waited(self.access)
        return done

    def __getattr__(self, name):
        return getattr(self.work, name)


@dataclass
class CommMonitor:
    """Shared by the groups of one ParallelState: the rules, the counters, the observers and this
    rank's communication activity."""
    rules_name: str | None = None
    counters: dict = field(default_factory=lambda: {k: Counter() for k in GROUP_KINDS})
    observers: list = field(default_factory=list)
    activity: Activity = field(default_factory=Activity)
    heartbeat: object = None  # parallel.runtime.heartbeat.Heartbeat, when one runs for this rank

    def __post_init__(self) -> None:
        self.rules = get_rules(self.rules_name)
        self._paused = 0

    def snapshot(self) -> dict[str, tuple[int, int, int]]:
        """(calls, payload bytes, wire bytes) per group kind, to diff against later."""
        return {k: (c.calls, c.payload_bytes, c.wire_bytes) for k, c in self.counters.items()}

    def since(self, snap: dict) -> dict[str, dict[str, int]]:
        """What each group kind issued since ``snap`` (a ``snapshot()``)."""
        out = {}
        for kind, c in self.counters.items():
            calls, payload, wire = snap.get(kind, (0, 0, 0))
            out[kind] = {"calls": c.calls - calls, "payload_bytes": c.payload_bytes - payload,
                         "wire_bytes": c.wire_bytes - wire}
        return out

    @contextmanager
    def uncounted(self):
        """Collectives issued inside are checked and observed but not counted (e.g. a step's own
        bookkeeping, which is not traffic of the training step)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def counting(self) -> bool:
        """False inside ``uncounted()``: an observer called now sees a collective that is not
        counted as the step's traffic."""
        return self._paused == 0

    def _account(self, event: CommEvent) -> None:
        for observer in self.observers:
            observer(event)
        if self._paused:
            return
        c = self.counters[event.group]
        c.calls += 1
        c.payload_bytes += event.payload_bytes
        c.wire_bytes += event.wire_bytes
