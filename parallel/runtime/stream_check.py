"""The stream-order checker: unordered accesses of one storage from two streams, found on the CPU.

PyTorch's CUDA Sanitizer (CSAN, TORCH_CUDA_SANITIZER=1) finds kernels on two streams that touch the same
memory without an event between them, but only on a GPU. This checker does the same over the
engine's own stream API (parallel/runtime/streams.py), so it runs in CPU CI: every side stream,
every worker thread and every communicator ("comm:<group kind>") is a named stream, and

- a ``TorchDispatchMode``, entered on every thread the checker is active on (the test's thread,
  threads of ``streams.start_thread``), sees each aten op and charges its accesses to the thread's
  current named stream: arguments the schema marks as written (``alias_info.is_write``) and fresh
  outputs are writes, the other tensor arguments reads (views are neither);
- the communication layer reports each collective (parallel/runtime/comm.py): an asynchronous one
  first orders its comm stream after the issuing stream, then accesses its tensors there (all-reduce
  and broadcast write their tensor, the others write the first and read the rest, a send reads, a
  receive writes); the handle's ``wait()`` (or ``is_completed()`` returning True) orders the
  waiting stream after it. A synchronous one accesses its tensors on the issuing stream itself,
  kept alive by nobody (ProcessGroupNCCL's model since torch 2.8: ``on_sync_collective``). The ops a backend runs
  inside the call or the wait (gloo copies a reduce-scatter's result into its output in
  ``wait()``) are the collective's own and not charged to the calling thread's stream;
- ``record_event`` / ``wait_event`` / ``wait_stream`` and thread start and join merge vector
  clocks, as the sanitizer's event handler does: stream T is ordered after access n of stream S
  when T's clock has S >= n.

A violation is recorded, naming both streams, both ops and where the storage was created, when on
one stream a storage is read after an unordered write of another stream, written after an
unordered read or write, or released (``streams.released``) or reused (its address handed out
again after Python dropped it) while another stream's access is not ordered before the stream
that allocated it, unless ``record_stream`` named that stream (the caching allocator then defers
the reuse). Accesses of comm streams (asynchronous collectives) do not hold a release of the last
reference back until a stream waits for the collective (ProcessGroupNCCL stashes the tensors until
``wait()``, then lets them go: a storage released after the wait, or before it and so going back
to its pool at the wait, needs its allocating stream ordered after the collective; a synchronous
one's accesses are the issuing stream's, which nothing keeps), but they do hold back a
storage resized to nothing (``streams.released(t, resized=True)``: ZeRO-3's freed buckets), which
frees the memory whoever holds the tensor. ``check()`` raises ``StreamOrderError`` listing them.

Storages are identified by ``untyped_storage().data_ptr()`` and a weak reference, so a new storage
at an old address is told from the old one; accesses conflict only where their byte ranges overlap.
Only what runs while the checker is active is seen. docs/streams.md says how tests turn it on.
What an op or a collective reads and writes, and where it was issued, is read by op_accesses.py.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.runtime import streams
from parallel.runtime.op_accesses import byte_range as _byte_range
from parallel.runtime.op_accesses import collective_operands as _collective_operands
from parallel.runtime.op_accesses import origin as _origin
from parallel.runtime.op_accesses import plan as _plan
from parallel.runtime.op_accesses import site as _site
from parallel.runtime.op_accesses import tensors as _tensors
from parallel.runtime.op_accesses import values as _values

class StreamOrderError(AssertionError):
    """Two streams touched one storage without an ordering between them."""


class Access(NamedTuple):   # (a tuple: made for every access the checker sees)
    stream: str
    seq: int
    op: str
    lo: int          # the byte range of the storage it touched
    hi: int
    write: bool
    kept: bool = True   # a collective's: the backend keeps the tensor alive until it completes


@dataclass
class CollectiveToken:
    """What an asynchronous collective's wait takes: the comm stream's clock after it and the
    (record, access) pairs it made, kept alive by the backend until that wait."""
    clock: dict
    touched: list


@dataclass
class StorageRecord:
    ref: StorageWeakRef
    origin: str
    alloc_stream: str
    accesses: list = field(default_factory=list)   # the last ones that may still conflict
    recorded: set = field(default_factory=set)     # streams named by record_stream
    released: bool = False


class _Mode(TorchDispatchMode):
    """One per thread (dispatch modes are thread-local): every aten op to the checker."""

    def __init__(self, checker: "StreamChecker"):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.checker.check_allocated(func, args, kwargs)
        out = func(*args, **kwargs)
        # collectives, and the backend's ops inside their calls and waits: reported by comm.py
        if func.namespace != "c10d" and not streams.in_collective():
            self.checker.on_op(func, args, kwargs, out)
        return out


class StreamChecker:
    """Vector clocks per named stream and, per storage, its recent accesses by byte range (the
    buckets of one flat gradient buffer are reduced while backward writes the next ones)."""

    def __init__(self):
        self.violations: list[str] = []
        self._clocks: dict[str, dict[str, int]] = {}
        self._records: dict[int, StorageRecord] = {}
        self._lock = threading.RLock()
        self._seen: set = set()

    # ---- installation ---------------------------------------------------------------------
    @contextmanager
    def active(self):
        """See this thread's aten ops while inside."""
        with _Mode(self):
            yield self

    @contextmanager
    def installed(self):
        """Install the checker in parallel.runtime.streams and make it active on this thread."""
        previous = streams.installed_checker()
        streams.install_checker(self)
        try:
            with self.active():
                yield self
        finally:
            if previous is not None:
                streams.install_checker(previous)
            else:
                streams.uninstall_checker()

    @property
    def streams(self) -> list[str]:
        """The named streams seen so far."""
        with self._lock:
            return sorted(self._clocks)

    def check(self) -> None:
        if self.violations:
            raise StreamOrderError(f"{len(self.violations)} stream-order violation(s):\n" +
                                   "\n".join(self.violations))

    # ---- clocks -----------------------------------------------------------------------------
    def _clock(self, stream: str) -> dict[str, int]:
        clock = self._clocks.get(stream)
        if clock is None:
            clock = self._clocks[stream] = {stream: 0}
        return clock

    def _tick(self, stream: str) -> int:
        clock = self._clock(stream)
        clock[stream] += 1
        return clock[stream]

    def _ordered(self, access: Access, stream: str) -> bool:
        return access.stream == stream or self._clock(stream).get(access.stream, 0) >= access.seq

    def on_record(self, stream: str) -> dict:
        with self._lock:
            return dict(self._clock(stream))

    def on_wait(self, stream: str, clock: dict) -> None:
        with self._lock:
            mine = self._clock(stream)
            for name, seq in clock.items():
                if seq > mine.get(name, 0):
                    mine[name] = seq

    # ---- storages ---------------------------------------------------------------------------
    def _record(self, t: torch.Tensor, stream: str, op: str, fresh: bool) -> StorageRecord | None:
        if t.is_meta or t.is_sparse:
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or storage.nbytes() == 0:
            return None
        rec = self._records.get(ptr)
        if rec is not None and (rec.ref.expired() or
                                (rec.released and rec.ref.cdata != storage._cdata)):
            # (a storage released while still alive, resized away: another one at its address)
            self._reused(rec, stream, op)
            rec = None
        if rec is None:
            origin = _origin(op) if fresh else _origin(op) + " (created before the checker saw it)"
            rec = self._records[ptr] = StorageRecord(StorageWeakRef(storage), origin, stream)
        return rec

    def _violation(self, kind: str, rec: StorageRecord, stream: str, op: str, other: Access,
                   pool: str | None = None) -> None:
        """Record one violation (once per kind, origin, streams and ops). ``pool``: for a release
        or reuse, the stream whose pool the block returns to."""
        site = _site() if pool is None else None   # where the op that found it was issued
        key = (kind, rec.origin, stream, other.stream, op, other.op, site)
        if key in self._seen:
            return
        self._seen.add(key)
        if pool == stream:  # a reuse: the new storage's op is on the pool's own stream
            what = f"{op} on stream '{stream}' takes its block, but that stream is not ordered " \
                   f"after {other.op} on stream '{other.stream}' (no event, wait or join, and " \
                   f"no record_stream for that stream)"
        elif pool is None:
            what = f"{op} on stream '{stream}' is not ordered after {other.op} on stream " \
                   f"'{other.stream}' (no event, wait or join between them)" + \
                   (f"; the {op} is issued at {site}" if site else "")
        else:
            what = f"{op} on stream '{stream}' hands the block to stream '{pool}', which is not " \
                   f"ordered after {other.op} on stream '{other.stream}' (no event, wait or " \
                   f"join, and no record_stream for that stream)"
        self.violations.append(f"{kind}: storage from {rec.origin}: {what}")

    def _touch(self, rec: StorageRecord, new: Access) -> None:
        """Check ``new`` against the overlapping accesses of other streams, then keep it; an
        access it fully covers is dropped (a later one ordered after ``new`` is after it too)."""
        keep = []
        for a in rec.accesses:
            overlaps = a.lo < new.hi and new.lo < a.hi
            if overlaps and (new.write or a.write) and not self._ordered(a, new.stream):
                kind = f"{'write' if new.write else 'read'} after an unordered " \
                       f"{'write' if a.write else 'read'}"
                self._violation(kind, rec, new.stream, new.op, a)
            covered = new.lo <= a.lo and a.hi <= new.hi and (new.write or
                                                              (a.stream == new.stream and not a.write))
            if not covered:
                keep.append(a)
        keep.append(new)
        rec.accesses = keep

    def _unfinished(self, rec: StorageRecord, stream: str, comm: bool = False) -> list[Access]:
        """Accesses of other streams that work on ``stream`` is not ordered after (comm streams'
        whose tensors the backend keeps alive, unless ``comm``, and record_stream-ed ones
        excepted)."""
        return [a for a in rec.accesses if (comm or not (a.kept and a.stream.startswith("comm:")))
                and a.stream not in rec.recorded and not self._ordered(a, stream)]

    def _reused(self, rec: StorageRecord, stream: str, op: str) -> None:
        if rec.released or rec.alloc_stream != stream:
            return  # checked when released; or another stream's pool (the allocator keeps them apart)
        for a in self._unfinished(rec, rec.alloc_stream):
            self._violation("reused while in use", rec, stream, f"{op} (a new storage)", a,
                            pool=stream)

    def on_free(self, t: torch.Tensor, stream: str, resized: bool = False) -> None:
        """``t``'s storage is released on ``stream``; ``resized``: resized to nothing, which frees
        it whatever a backend holds (comm streams' accesses count too)."""
        with self._lock:
            rec = self._record(t, stream, "release", False)
            if rec is None:
                return
            for a in self._unfinished(rec, rec.alloc_stream, comm=resized):
                self._violation("released while in use", rec, stream, "the release", a,
                                pool=rec.alloc_stream)
            rec.released = True

    def on_alloc(self, t: torch.Tensor, stream: str) -> None:
        """``t``'s storage got new memory on ``stream`` (a resize): a new record, made on
        ``stream``; the old record at that address, if its storage was not released, is a reuse."""
        with self._lock:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if t.device.type == "meta" or ptr == 0 or storage.nbytes() == 0:
                return
            rec = self._records.pop(ptr, None)
            if rec is not None:
                self._reused(rec, stream, "resize")
            self._records[ptr] = StorageRecord(StorageWeakRef(storage), _origin("resize"), stream)

    def on_record_stream(self, t: torch.Tensor, stream: str) -> None:
        with self._lock:
            rec = self._record(t, streams.current_stream_name(), "record_stream", False)
            if rec is not None:
                rec.recorded.add(stream)

    def access(self, stream: str, reads: list, writes: list, op: str, fresh: tuple = (),
               kept: bool = True, touched: list | None = None) -> None:
        """One op on ``stream``: ``reads`` and ``writes`` are tensors; ``fresh`` (a subset of
        ``writes``) were allocated by it; ``kept``: see ``on_collective``; ``touched``: a list
        that gets each (record, access) made."""
        with self._lock:
            seq = self._tick(stream)
            written = []
            for tensors, write in ((writes, True), (reads, False)):
                for t in tensors:
                    span = _byte_range(t)
                    rec = None if span is None else \
                        self._record(t, stream, op, write and any(t is f for f in fresh))
                    if rec is None or (not write and (id(rec), span) in written):
                        continue
                    if write:
                        written.append((id(rec), span))
                    made = Access(stream, seq, op, span[0], span[1], write, kept)
                    self._touch(rec, made)
                    if touched is not None:
                        touched.append((rec, made))

    # ---- event sources ------------------------------------------------------------------------
    def check_allocated(self, func, args, kwargs) -> None:
        """Before an op runs: an argument with elements whose storage holds no bytes (a ZeRO-3
        bucket that was freed and not gathered again) would be read from freed memory (a crash on
        the CPU, garbage on a device): raise naming the op and where it was issued."""
        for value in _values(_plan(func).read_or_written, args, kwargs):
            for t in _tensors(value):
                if t.is_meta or t.is_sparse or not t.numel():
                    continue
                try:
                    freed = t.untyped_storage().nbytes() == 0
                except (RuntimeError, NotImplementedError):   # a tensor without a storage
                    continue
                if freed:
                    message = (f"read of a freed storage: {func.overloadpacket.__name__} on stream "
                               f"'{streams.current_stream_name()}' takes a tensor of shape "
                               f"{list(t.shape)} whose storage was freed (a ZeRO-3 bucket not "
                               f"gathered for this read)")
                    site = _site()
                    message += f"; issued at {site}" if site else ""
                    with self._lock:
                        self.violations.append(message)
                    raise StreamOrderError(message)

    def on_op(self, func, args, kwargs, out) -> None:
        plan = _plan(func)
        reads, writes = [], []
        for value in _values(plan.written, args, kwargs):
            writes += _tensors(value)
        for value in _values(plan.read, args, kwargs):
            reads += _tensors(value)
        fresh = []
        outs = out if len(plan.fresh_returns) > 1 else (out,)
        for fresh_out, value in zip(plan.fresh_returns, outs):
            if fresh_out:
                fresh += _tensors(value)
        if reads or writes or fresh:
            self.access(streams.current_stream_name(), reads, writes + fresh, plan.name,
                        tuple(fresh))

    def on_collective(self, op: str, group: str, tensors: list, issuer: str,
                      kept: bool = True) -> "CollectiveToken":
        """An async collective: ordered after ``issuer``, its accesses on "comm:<group>", kept
        alive by the backend until a stream waits for it (``on_collective_wait``: ProcessGroupNCCL
        stashes an asynchronous collective's tensors until ``wait()`` since torch 2.8, and then
        lets them go, however far the device is). ``kept=False``: not even that (HCCL's batched
        point-to-point beyond the batch's first tensor), so releasing one before the collective
        is waited for is reported like any other stream's unfinished access."""
        comm = f"comm:{group}"
        with self._lock:
            self.on_wait(comm, self.on_record(issuer))
            touched = []
            self.access(comm, *_collective_operands(op, tensors), f"{op} on {group}", kept=kept,
                        touched=touched)
            return CollectiveToken(self.on_record(comm), touched)

    def on_collective_wait(self, stream: str, token: "CollectiveToken") -> None:
        """``stream`` waits for the collective of ``token``; from now on nothing keeps its tensors
        alive: a storage released after this must have its allocating stream ordered after the
        collective (or ``record_stream``), and one the caller released while the backend still
        held it goes back to its pool now, so the same holds for it at this point."""
        with self._lock:
            self.on_wait(stream, token.clock)
            for rec, made in token.touched:
                if made in rec.accesses:
                    rec.accesses[rec.accesses.index(made)] = made._replace(kept=False)
                if rec.released and made.kept and not self._ordered(made, rec.alloc_stream) \
                        and made.stream not in rec.recorded:
                    self._violation("released while in use", rec, stream,
                                    "the release (when the wait let the backend's reference go)",
                                    made, pool=rec.alloc_stream)
            token.touched = []

    def on_sync_collective(self, op: str, group: str, tensors: list, issuer: str) -> None:
        """A synchronous collective: its accesses on the issuing stream itself, kept by nobody.
        ProcessGroupNCCL (torch >= 2.8, pytorch#150398) launches a collective with
        ``async_op=False`` on the current stream and no longer keeps its tensors alive, so a
        tensor another stream allocated must not be dropped until that stream is ordered after
        it (or ``record_stream`` names the issuing stream). (HCCL runs it on its own stream and
        records the tensors there: safe under this model too, which is the stricter of the two.)"""
        self.access(issuer, *_collective_operands(op, tensors), f"{op} on {group}", kept=False)
