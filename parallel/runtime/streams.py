"""Side streams, events and worker threads: the one API through which the engine orders device work.

Every piece of the engine that runs device work off the compute stream (the DP exchange worker,
ZeRO-2's storage release, the asynchronous checkpoint copy, the pipeline watchdog) goes through
this module instead of calling ``torch.Stream`` / ``torch.Event`` or ``threading.Thread`` itself:

- ``side_stream(name, device, high_priority=False)``: a named ``Stream``; on an accelerator it wraps
  a ``torch.Stream`` (from the high-priority pool, which no communicator uses, when asked), on the
  CPU it is a name only;
- ``current_stream(device)``, ``use(stream)``: the stream this thread issues work on now;
- ``record_event``, ``wait_event``, ``wait_stream``, ``synchronize``, ``record_stream``,
  ``released``: the orderings the engine relies on (``synchronize``: the host waits for an
  event; ``observing_host_waits`` lets a counter see each such wait), and the release of a
  storage another stream may still read;
- ``to_device(t, device)``: a host tensor copied to the device without a host wait (pinned,
  asynchronous);
- ``start_thread(name, target, device)``: a worker thread that binds the rank's device first (as
  ProcessGroupHCCL's watchdog does: a thread starts on device 0 otherwise, and its first device
  call would create a context there) and reports an exception instead of dying silently.

Why a module of its own: the same calls are what the stream-order checker
(``parallel.runtime.stream_check``) observes. On the CPU there are no streams, so the checker treats
every side stream and every worker thread as a named stream and proves, in CPU CI, that each access
of a storage from one stream is ordered after the conflicting accesses from the others by exactly
the events, waits and joins the engine issues here. The checker is installed explicitly
(``install_checker``), by tests; without one every call below is the plain device operation (a
no-op on the CPU). It lives in parallel/ rather than engine/device/ because parallel/ may not
import engine/; engine.device re-exports it.

The compute stream is named "compute"; a thread started here runs on a stream named after the
thread until it ``use``-s another; an asynchronous collective runs on "comm:<group kind>".
"""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

COMPUTE = "compute"
_checker = None          # the installed StreamChecker (tests only), or None
_local = threading.local()


def _accelerator(device) -> bool:
    return device is not None and torch.device(device).type not in ("cpu", "meta")


@dataclass(eq=False)
class Stream:
    """A named stream; ``native`` is the torch.Stream on an accelerator, None on the CPU. To the
    checker, streams of one name are one stream (name them apart when they must be told apart)."""
    name: str
    device: torch.device
    native: object = None

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, {self.device})"


@dataclass(eq=False)
class Event:
    """A point on a stream that other streams can wait for; ``clock`` is the checker's record."""
    stream: Stream
    native: object = None
    clock: object = None


def install_checker(checker) -> None:
    """Route every call of this module (and the communication layer's) through ``checker``."""
    global _checker
    _checker = checker


def uninstall_checker() -> None:
    global _checker
    _checker = None


def installed_checker():
    return _checker


def checking() -> bool:
    """Whether a stream-order checker is installed (the communication layer's fast path)."""
    return _checker is not None


HIGH_PRIORITY = -1   # torch.Stream's priority: 0 (the default) or negative, higher first


def side_stream(name: str, device, high_priority: bool = False) -> Stream:
    """A new named side stream on ``device`` (a name only on the CPU). ``high_priority``: from
    the device's high-priority pool, whose streams the scheduler runs first and which no
    communicator takes (CUDA and torch_npu hand out a device's pooled streams round-robin, 32
    per priority, and ProcessGroupNCCL takes each communicator's stream from the low-priority
    pool: a default side stream can be a communicator's stream and queue behind its
    collectives). For short copies a step waits on (the MoE split sizes, the offloaded
    optimizer's gradients and parameters)."""
    device = torch.device(device)
    native = None
    if _accelerator(device):
        native = torch.Stream(device=device, priority=HIGH_PRIORITY if high_priority else 0)
    return Stream(name, device, native)


def _default_name() -> str:
    name = getattr(_local, "thread_stream", None)
    if name is not None:
        return name
    if threading.current_thread() is threading.main_thread():
        return COMPUTE
    return f"thread:{threading.current_thread().name}"


def current_stream(device=None) -> Stream:
    """The stream this thread issues work on: the innermost ``use``, else the thread's own on
    ``device`` (None: the device a ``start_thread`` thread was bound to). Outside both, a call
    without a device is refused: on an accelerator a guess of "cpu" would be a stream with nothing
    behind it, and every wait on it a silent no-op."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    if device is None:
        device = getattr(_local, "device", None)
    if device is None:
        raise ValueError("streams.current_stream: no device given and none bound to this thread; "
                         "pass the device whose stream is meant")
    device = torch.device(device)
    native = torch.accelerator.current_stream(device) if _accelerator(device) else None
    return Stream(_default_name(), device, native)


def current_stream_name() -> str:
    """The name of ``current_stream()``, without asking the device runtime."""
    stack = getattr(_local, "stack", None)
    return stack[-1].name if stack else _default_name()


@contextmanager
def use(stream: Stream):
    """Issue work on ``stream`` inside (``with torch.Stream`` on an accelerator)."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(stream)
    try:
        with (stream.native if stream.native is not None else nullcontext()):
            yield stream
    finally:
        stack.pop()


def record_event(stream: Stream | None = None) -> Event:
    """An event at the current end of ``stream`` (default: the current one, inside ``use`` or on
    a bound thread)."""
    stream = stream or current_stream()
    native = None
    if stream.native is not None:
        native = torch.Event(device=stream.device)
        native.record(stream.native)
    clock = _checker.on_record(stream.name) if _checker is not None else None
    return Event(stream, native, clock)


def wait_event(event: Event, stream: Stream | None = None) -> None:
    """Work issued on ``stream`` (default: the current one on the event's device) from now on
    runs after ``event``."""
    stream = stream or current_stream(event.stream.device)
    if stream.native is not None and event.native is not None:
        stream.native.wait_event(event.native)
    if _checker is not None and event.clock is not None:
        _checker.on_wait(stream.name, event.clock)


@contextmanager
def observing_host_waits(observe: Callable[[str], None]):
    """Inside, ``observe("event.synchronize")`` is called for every host wait on a device event
    (``synchronize`` with a native event) this thread makes: the step's wait counter
    (engine/device/syncs.py) sees them through it, as neither its patched tensor methods nor
    CUDA's own sync report (``cudaEventSynchronize`` is not reported) do."""
    outer = getattr(_local, "observe_host_wait", None)
    _local.observe_host_wait = observe
    try:
        yield
    finally:
        _local.observe_host_wait = outer


def synchronize(event: Event) -> None:
    """The calling thread (the host) waits until ``event`` has happened on its device; what it
    does next is ordered after the event's stream up to the event."""
    if event.native is not None:
        event.native.synchronize()
        observe = getattr(_local, "observe_host_wait", None)
        if observe is not None:
            observe("event.synchronize")
    if _checker is not None and event.clock is not None:
        _checker.on_wait(current_stream_name(), event.clock)


def wait_stream(stream: Stream, other: Stream) -> None:
    """Work issued on ``stream`` from now on runs after everything issued on ``other`` so far."""
    wait_event(record_event(other), stream)


def record_stream(tensor: torch.Tensor, stream: Stream | None) -> None:
    """Tell the caching allocator that ``stream``'s queued work uses ``tensor``: its block is
    reused only once that work is done, whichever stream frees it."""
    if stream is None:
        return
    if stream.native is not None:
        tensor.record_stream(stream.native)
    if _checker is not None:
        _checker.on_record_stream(tensor, stream.name)


def released(tensor: torch.Tensor | None, resized: bool = False) -> None:
    """The caller drops its last reference to ``tensor``'s storage (its block goes back to the
    allocator's pool), or (``resized``) resizes the storage to nothing (ZeRO-3's freed buckets):
    the checker verifies that no other stream still uses it. A resize frees the memory whoever
    else holds the tensor, so a collective's own reference to it (NCCL keeps its tensors until
    the work is waited) does not keep it: a comm stream's access must be waited for too."""
    if _checker is not None and tensor is not None:
        _checker.on_free(tensor, current_stream_name(), resized)


def allocated(tensor: torch.Tensor) -> None:
    """``tensor``'s storage was just given new memory on the current stream without an op that
    writes it (a storage resized back, ZeRO-3's gather): to the checker a new storage, whose
    block the allocator may have handed back from earlier use."""
    if _checker is not None:
        _checker.on_alloc(tensor, current_stream_name())


# ---- threads --------------------------------------------------------------------------------
def bind_device(device) -> None:
    """Make ``device`` this thread's current device (an accelerator's per-thread state)."""
    device = torch.device(device)
    _local.device = device
    if not _accelerator(device) or device.index is None:
        return
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "set_device_index"):
        torch.accelerator.set_device_index(device.index)
    else:  # older torch: the device module's own call (torch.npu, ...)
        getattr(torch, device.type).set_device(device.index)


def report_and_exit(name: str, exc: BaseException) -> None:
    """The default for a failing thread: one line on stderr, then the process ends (the launcher
    ends the job); a thread that dies silently would leave the job waiting for it."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    print(f"gridtron: thread {name} failed: {type(exc).__name__}: {first}", file=sys.stderr,
          flush=True)
    os._exit(70)


class StreamThread:
    """A started worker thread; ``join()`` and ``finished()`` order the caller after its work."""

    def __init__(self, name: str, target: Callable[[], None], device, daemon: bool,
                 on_error: Callable[[BaseException], None] | None):
        self.name, self.device = name, torch.device(device)
        self.on_error, self.error = on_error, None
        self._end: Event | None = None
        self._done = threading.Event()
        if _checker is not None:  # the thread's work starts after the caller's so far
            _checker.on_wait(name, _checker.on_record(current_stream_name()))
        self.thread = threading.Thread(target=self._main, args=(target,), name=name, daemon=daemon)
        self.thread.start()

    def _main(self, target) -> None:
        _local.thread_stream = self.name
        checker = _checker
        try:
            bind_device(self.device)
            with (checker.active() if checker is not None else nullcontext()):
                try:
                    target()
                finally:
                    self._end = record_event(current_stream(self.device))
        except BaseException as exc:  # noqa: BLE001 - handed to on_error, never dropped
            self.error = exc
            (self.on_error or (lambda e: report_and_exit(self.name, e)))(exc)
        finally:
            self._done.set()

    def _ordered(self) -> None:
        if self._end is not None:  # the caller's stream on the thread's device
            wait_event(self._end, current_stream(self.device))

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self._ordered()

    def finished(self) -> bool:
        """Whether the thread's work is done; if so, what follows here is ordered after it."""
        if not self._done.is_set():
            return False
        self._ordered()
        return True

    def is_alive(self) -> bool:
        return self.thread.is_alive()


def start_thread(name: str, target: Callable[[], None], device, daemon: bool = True,
                 on_error: Callable[[BaseException], None] | None = None) -> StreamThread:
    """Run ``target()`` on a new thread bound to ``device``. An exception ends the process with
    one line naming the thread (``report_and_exit``) unless ``on_error`` takes it."""
    return StreamThread(name, target, device, daemon, on_error)


# ---- the communication layer's hooks (parallel/runtime/comm.py)
# ---------------------------------------
def collective_issued(op: str, group: str, tensors: list, async_op: bool, kept: bool = True):
    """An asynchronous collective on ``group`` starts after the issuing stream's work so far and
    accesses ``tensors`` on "comm:<group>"; returns what ``collective_waited`` takes (None when
    no checker is installed). A synchronous one accesses them on the issuing stream, and nothing
    keeps them alive after the call (NCCL's model, stream_check.py). ``kept=False``: the backend
    does not keep an asynchronous collective's tensors alive until it completes."""
    if _checker is None:
        return None
    if not async_op:
        _checker.on_sync_collective(op, group, tensors, current_stream_name())
        return None
    return _checker.on_collective(op, group, tensors, current_stream_name(), kept)


@contextmanager
def collective_call():
    """Inside a collective's call or its handle's wait(): the ops the backend runs here (gloo's
    copies into a reduce-scatter's output, ...) are the collective's own, already reported."""
    _local.in_collective = getattr(_local, "in_collective", 0) + 1
    try:
        yield
    finally:
        _local.in_collective -= 1


def in_collective() -> bool:
    return getattr(_local, "in_collective", 0) > 0


def collective_waited(token) -> None:
    """The current stream waits for the collective of ``token`` (its handle's wait(), or
    is_completed() returning True)."""
    if _checker is not None and token is not None:
        _checker.on_collective_wait(current_stream_name(), token)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without a host wait: copied from pinned memory,
    asynchronously. A copy from pageable memory makes the host wait for the stream to drain
    (CUDA's ``memcpy_and_sync``: the step's batch copied so would hold the next forward's launch
    until the previous step's update ran). The caching host allocator keeps the pinned block
    until its copy is done (it records an event on it), so the caller may drop the tensor. On the
    CPU the tensor itself; to the meta device (a dry run) nothing is pinned."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t.to(device)
    source = t.pin_memory() if t.device.type == "cpu" and device.type != "meta" else t
    return source.to(device, non_blocking=True)
