"""Every collective the engine issues goes through here: named process groups with backend rules,
byte counters and observers.

A ``CommGroup`` is one process group of the rank grid (kind "tp", "cp", "pp", "dp", "dp_cp", "mp",
"embedding" or "world", or of the expert grid: "ep", "edp") with its global ranks, this rank's
index in it and a ``CommMonitor`` shared by all groups of one ``ParallelState``. Its methods are
thin wrappers over torch.distributed that

1. check the call against the backend's rules (``parallel.runtime.backend_rules``: HCCL refuses
   float64 reductions and ``gather``, NCCL refuses int16, ...) before anything is sent, so a
   collective the real backend would refuse fails the CPU suite too; with rules on, a group is also
   refused to a thread outside its ``lane`` (``parallel.runtime.lanes``: a worker thread has
   communicators of its own);
2. count, per group kind, the payload this rank hands over (the bytes of the tensor it passes:
   all-reduce and reduce-scatter their input buffer, all-gather its own shard, all-to-all its send
   buffer, point-to-point its sends, broadcast the source's buffer) and the ring-model estimate of
   what it puts on the wire::

       all_reduce(S)      2 (n-1)/n * S      reduce_scatter(S)  (n-1)/n * S
       all_to_all(S)        (n-1)/n * S      all_gather(s)      (n-1) * s
       send(S)                      S        broadcast(S)       (n-1)/n * S

3. tell observers (``monitor.observers``) about each call: op, group kind and ranks, dtype,
   payload bytes, before it is issued (used by tests to check ordering, and by tools that record a
   step's communication);
4. keep this rank's ``Activity`` (``monitor.activity``): how many collectives it has entered on
   each of its groups, the last one, the one the host is blocked in right now and, when a clock is
   set, the spans of time it spent blocked (inside a synchronous call, or in ``wait()`` on the
   handle of an asynchronous one). The heartbeat (parallel/runtime/heartbeat.py) publishes it so
   that a rank stuck in a collective can name the peers that never entered it; the straggler report
   (engine/observe/stragglers.py) sums the spans;
5. report each collective's tensors, and each ``wait()`` / completed ``is_completed()`` of its
   handle, to the stream-order checker when a test installed one (parallel/runtime/streams.py,
   parallel/runtime/stream_check.py); otherwise that is a no-op.

Inside a ``torch.compile`` graph only the rules apply (at trace time): the TP and CP collectives of
compiled model chunks are not counted, so the trainer reports ``tp_comm_bytes`` and
``cp_comm_bytes`` as null under ``--compile``.

A group of size 1 is a no-op for every collective (nothing checked, counted or sent), so serial runs
and ``ParallelState.serial()`` need no process group at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from parallel.runtime import streams
from parallel.runtime.backend_rules import check, check_batch, check_object
from parallel.runtime.comm_monitor import GROUP_KINDS, CommEvent, CommMonitor, TrackedWork, wire_bytes
from parallel.runtime.lanes import MAIN_LANE, check_lane

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _single(name_new: str, name_old: str) -> Callable:
    """torch 2.13 names the single-tensor collectives all_gather_single / reduce_scatter_single."""
    return getattr(dist, name_new, None) or getattr(dist, name_old)


_all_gather_single = _single("all_gather_single", "all_gather_into_tensor")
_reduce_scatter_single = _single("reduce_scatter_single", "reduce_scatter_tensor")


@dataclass(eq=False)
class CommGroup:
    """One process group of the grid; ``pg`` is None when the group has a single rank (or is the
    default group, see ``world``)."""
    kind: str
    ranks: tuple
    rank: int                         # this rank's index in ``ranks``
    pg: object = None
    monitor: CommMonitor = field(default_factory=CommMonitor)
    world: bool = False               # the default (world) group: pg None means "default group"
    lane: str = MAIN_LANE             # the threads that may issue on it (parallel/runtime/lanes.py)
    first_thread: str | None = field(default=None, repr=False)  # for check_lane's message

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"CommGroup: unknown kind {self.kind!r}; use one of {GROUP_KINDS}")
        self.ranks = tuple(self.ranks)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def process_group(self):
        """What torch.distributed calls take as ``group=``."""
        return None if self.world else self.pg

    def __repr__(self) -> str:
        lane = "" if self.lane == MAIN_LANE else f", lane={self.lane}"
        return f"CommGroup({self.kind}, ranks={list(self.ranks)}{lane})"

    # ---- bookkeeping ------------------------------------------------------------------------
    def _issue(self, op: str, tensor: torch.Tensor | None, payload: int | None = None,
               async_op: bool = False, reduce_op=None, tensors=None, received: int = 0) -> None:
        monitor = self.monitor
        rules = monitor.rules
        compiling = torch.compiler.is_compiling()
        if rules is not None:
            check(rules, op, self.kind, tensors if tensors is not None else
                  ([tensor] if tensor is not None else []), reduce_op, cache=not compiling)
        if compiling:
            # inside a torch.compile graph the rules are checked once, when it is traced; counting
            # would be a Python side effect that breaks the graph, so compiled regions are not
            # counted (the trainer reports their traffic kinds as null under --compile)
            return
        if rules is not None:
            check_lane(rules, self, op)   # one communicator, one thread (parallel/runtime/lanes.py)
        nbytes = _nbytes(tensor) if payload is None and tensor is not None else (payload or 0)
        if not monitor.observers:  # the common case: count, without building the event
            if not monitor._paused:
                c = monitor.counters[self.kind]
                c.calls += 1
                c.payload_bytes += nbytes
                c.wire_bytes += wire_bytes(op, nbytes, self.size)
            return
        monitor._account(CommEvent(op, self.kind, self.ranks,
                                   None if tensor is None else str(tensor.dtype)[6:], nbytes,
                                   wire_bytes(op, nbytes, self.size), async_op, received, self.lane))

    def _run(self, name: str, fn: Callable, /, *args, async_op: bool = False, **kwargs):
        """Issue the torch.distributed call ``fn`` as collective ``name`` of this group in the
        rank's Activity; an asynchronous call's handle comes back as a ``TrackedWork``."""
        if torch.compiler.is_compiling():
            return fn(*args, async_op=async_op, **kwargs)
        activity = self.monitor.activity
        if not streams.checking():  # the common case: no stream-order checker installed
            tag = activity.enter(name, self.kind, self.lane)
            work = activity.block(tag, fn, *args, async_op=async_op, **kwargs)
            return TrackedWork(work, activity, tag) if async_op and work is not None else work
        access = streams.collective_issued(name, self._stream_name(),
                                           [a for a in args if isinstance(a, torch.Tensor)], async_op)
        tag = activity.enter(name, self.kind, self.lane)
        with streams.collective_call():
            work = activity.block(tag, fn, *args, async_op=async_op, **kwargs)
        return TrackedWork(work, activity, tag, access) if async_op and work is not None else work

    def _stream_name(self) -> str:
        """The communicator's stream for the stream-order checker: one per group and lane."""
        return self.kind if self.lane == MAIN_LANE else f"{self.kind}/{self.lane}"

    # ---- tensor collectives (in place or into ``out``) ---------------------------------------
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size == 1:
            return None
        self._issue("all_reduce", t, async_op=async_op, reduce_op=op)
        return self._run("all_reduce", dist.all_reduce, t, op=op, group=self.process_group,
                         async_op=async_op)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """Concatenate every rank's ``t`` (equal shapes) along dim 0 into ``out``."""
        if self.size == 1:
            out.copy_(t.reshape(out.shape))
            return None
        self._issue("all_gather", t, async_op=async_op, tensors=[t, out])
        return self._run("all_gather", _all_gather_single, out, t, group=self.process_group,
                         async_op=async_op)

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, op=dist.ReduceOp.SUM,
                            async_op: bool = False):
        """Sum ``t`` over the group and keep this rank's equal dim-0 slice in ``out``."""
        if self.size == 1:
            out.copy_(t.reshape(out.shape))
            return None
        self._issue("reduce_scatter", t, async_op=async_op, reduce_op=op, tensors=[t, out])
        return self._run("reduce_scatter", _reduce_scatter_single, out, t, op=op,
                         group=self.process_group, async_op=async_op)

    def all_to_all_single(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """Equal splits along dim 0: piece j of ``t`` goes to rank j, piece i of ``out`` comes from i."""
        if self.size == 1:
            out.copy_(t.reshape(out.shape))
            return None
        self._issue("all_to_all", t, async_op=async_op, tensors=[t, out])
        return self._run("all_to_all", dist.all_to_all_single, out, t, group=self.process_group,
                         async_op=async_op)

    def all_to_all_v(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int],
                     in_splits: list[int]):
        """Uneven splits along dim 0: rows ``in_splits[j]`` of ``t`` go to rank j, ``out`` gets
        ``out_splits[i]`` rows from rank i (expert-parallel token dispatch)."""
        if self.size == 1:
            out.copy_(t.reshape(out.shape))
            return None
        self._issue("all_to_all", t, tensors=[t, out])
        return self._run("all_to_all", dist.all_to_all_single, out, t, output_split_sizes=out_splits,
                         input_split_sizes=in_splits, group=self.process_group)

    def broadcast(self, t: torch.Tensor, src: int = 0, async_op: bool = False):
        """``src`` is the index in this group (0: its first rank)."""
        if self.size == 1:
            return None
        self._issue("broadcast", t, payload=_nbytes(t) if self.rank == src else 0,
                    async_op=async_op)
        return self._run("broadcast", dist.broadcast, t, src=self.ranks[src],
                         group=self.process_group, async_op=async_op)

    def barrier(self) -> None:
        if self.size == 1:
            return
        self._issue("barrier", None)
        self._run("barrier", lambda async_op: dist.barrier(group=self.process_group))

    # ---- point to point ------------------------------------------------------------------------
    def batch_isend_irecv(self, transfers: list[tuple[str, torch.Tensor, int]]) -> list:
        """Post ("send" | "recv", tensor, peer global rank) transfers as one batch; returns works."""
        check_batch(self.monitor.rules, self.kind, transfers)
        ops = []
        for kind, t, peer in transfers:
            if kind == "send":
                self._issue("send", t)
            else:
                self._issue("recv", t, payload=0, received=_nbytes(t))
            ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer,
                                  self.process_group))
        if not ops:
            return []
        rules = self.monitor.rules
        first_only = rules is not None and rules.batch_keeps_first   # HCCL: the rest unprotected
        accesses = [streams.collective_issued(kind, self._stream_name(), [t], True,
                                              kept=not (first_only and i))
                    for i, (kind, t, _) in enumerate(transfers)]
        activity = self.monitor.activity
        tag = activity.enter("p2p", self.kind)
        with streams.collective_call():
            works = activity.block(tag, dist.batch_isend_irecv, ops)
        if len(works) != len(accesses):  # one coalesced work: waiting for it covers them all
            last = accesses[-1]
            if last is not None:  # its comm clock is after every transfer's: it takes all records
                last.touched = [pair for a in accesses for pair in a.touched]
            accesses = [last] * len(works)
        return [TrackedWork(w, activity, tag, a) for w, a in zip(works, accesses)]

    # ---- object collectives (setup, checkpoints, timelines: never in the step)
    # --------------------
    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        check_object(self.monitor.rules, "all_gather_object", self.kind, obj)
        self._issue("object", None)
        out = [None] * self.size
        self._run("object", lambda async_op: dist.all_gather_object(out, obj, group=self.process_group))
        return out

    def failures(self, line: str | None) -> list[tuple[int, str]]:
        """Every rank's failure, agreed in one all-gather: ``line`` is this rank's (None: it did
        not fail); returns (global rank, line) of each rank that failed, lowest first."""
        return [(rank, why) for rank, why in zip(self.ranks, self.all_gather_object(line)) if why]

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of group rank ``src`` on every rank (others pass anything, e.g. None)."""
        if self.size == 1:
            return obj
        if self.rank == src:
            check_object(self.monitor.rules, "broadcast_object_list", self.kind, obj)
        self._issue("object", None)
        box = [obj]
        self._run("object", lambda async_op: dist.broadcast_object_list(
            box, src=self.ranks[src], group=self.process_group))
        return box[0]


def single_rank_group(kind: str, rank: int = 0, monitor: CommMonitor | None = None) -> CommGroup:
    """A group of one rank: every collective on it is a no-op."""
    return CommGroup(kind, (rank,), 0, None, monitor or CommMonitor())


def group_size(group: CommGroup | None) -> int:
    return 1 if group is None else group.size
