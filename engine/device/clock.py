"""Device time: stamps on the device's current stream and the seconds between them.

Host clocks around asynchronous kernels measure launches, not work. Every timing path (the
pipeline executor, the step timers, the timeline) stamps the device's stream instead: on CUDA and
NPU an event recorded on the current stream (torch.cuda.Event / torch.npu.Event with
enable_timing=True), read with elapsed_time after the later event has completed; on CPU, where
operations run synchronously on the calling thread, time.perf_counter().

Every wait for the device goes through the clock and is counted by its ``syncs``
(engine/device/syncs.py): ``synchronize``, ``read`` (a step's one blocking read of a tensor) and
an ``elapsed_s`` whose later stamp the device has not reached yet. After a ``read`` everything
stamped before it is complete, so the step's spans are read there without waiting, and the
clock's anchor moves there: the stream has just drained, so "now" on the host is "now" on the
device, with no ``synchronize`` of its own. On CPU the same bookkeeping runs on perf_counter
stamps (a stamp later than the last read would wait on a GPU, and counts), so CPU tests count
what a GPU run would.
"""
from __future__ import annotations

import time

import torch

from engine.device.runtime import BACKENDS
from engine.device.syncs import SyncCounter


def counter_for(kind: str) -> SyncCounter:
    """The step's wait counter for a device type: on CUDA the runtime's own report (the sync
    debug mode, engine/device/native_syncs.py); elsewhere the dispatch mode that names every op
    a GPU or NPU waits for (engine/device/sync_ops.py)."""
    if kind == "cuda":
        from engine.device.native_syncs import cuda_sync_warnings
        return SyncCounter(native=cuda_sync_warnings, device_type=kind)
    return SyncCounter(strict=True, device_type=kind)


class DeviceClock:
    """Stamps on a device's current stream and the seconds between them.

        clock = DeviceClock("cuda")
        clock.anchor()                # synchronize; the wall time of "now" on the device
        a = clock.stamp(); ...work...; b = clock.stamp()
        clock.elapsed_s(a, b)         # device seconds between the stamps (waits for b)
        clock.wall(b)                 # b in epoch seconds, to line up the ranks of a timeline

    ``wall`` counts from the last ``anchor()``: the anchor synchronizes the device (so its stream is
    idle), records an event and reads ``time.time()`` at the same moment. Ranks on one host share
    that clock; ranks on different hosts line up as well as their host clocks agree (NTP).
    """

    def __init__(self, kind: str = "cpu", syncs: SyncCounter | None = None):
        if kind not in BACKENDS:
            raise ValueError(f"DeviceClock: device type must be one of {sorted(BACKENDS)}, got {kind!r}")
        self.kind = kind
        self.syncs = syncs or counter_for(kind)
        self._anchor = None
        self._anchor_wall = 0.0
        self._settled = float("-inf")  # CPU: perf_counter of the last wait (stamps up to it are done)

    def _event(self):
        if self.kind == "cuda":
            return torch.cuda.Event(enable_timing=True)
        return torch.npu.Event(enable_timing=True)

    def synchronize(self, name: str = "synchronize") -> None:
        """Wait until the device is idle (counted as ``name``)."""
        with self.syncs.ignored():  # counted once, here, under its name
            if self.kind == "cuda":
                torch.cuda.synchronize()
            elif self.kind == "npu":
                torch.npu.synchronize()
        self._settle()
        self.syncs.count(name, self.stamp())

    def read(self, tensor: torch.Tensor, name: str) -> list:
        """``tensor.tolist()``: a blocking read, counted as ``name``; afterwards every stamp made
        so far is complete and the anchor is "now" (the stream just drained up to the read)."""
        stamp = self.stamp()
        with self.syncs.ignored():
            values = tensor.tolist()
        self.syncs.count(name, stamp)
        self._settle()
        self._anchor_wall, self._anchor = time.time(), self.stamp()
        return values

    def _settle(self) -> None:
        self._settled = time.perf_counter()

    def _done(self, stamp) -> bool:
        if self.kind == "cpu":
            return stamp <= self._settled
        query = getattr(stamp, "query", None)
        return bool(query()) if query is not None else False

    def stamp(self):
        """Mark "now" on the current stream: an event (CUDA/NPU) or perf_counter() seconds (CPU)."""
        if self.kind == "cpu":
            return time.perf_counter()
        event = self._event()
        event.record()
        return event

    def elapsed_s(self, start, end) -> float:
        """Device seconds from stamp ``start`` to stamp ``end`` (waits until ``end`` completed)."""
        if not self._done(end):
            self.syncs.count("event wait", end)
            if self.kind != "cpu":
                with self.syncs.ignored():
                    end.synchronize()
            self._settle()
        if self.kind == "cpu":
            return end - start
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    def anchor(self) -> None:
        """Synchronize, then tie a fresh stamp to the host's epoch clock (see ``wall``); ``read``
        moves the anchor too, without a synchronize of its own."""
        self.synchronize("anchor")
        self._anchor_wall = time.time()
        self._anchor = self.stamp()

    def wall(self, stamp) -> float:
        """Epoch seconds of ``stamp``: the anchor's wall time plus the device time since it."""
        return self.timebase()(stamp)

    def timebase(self):
        """``wall`` bound to the current anchor, for stamps read after a later ``anchor()``. Take
        it before the stamps it will convert: they must come after its anchor."""
        if self._anchor is None:
            raise RuntimeError("DeviceClock.wall needs anchor() first")
        anchor, anchor_wall = self._anchor, self._anchor_wall
        return lambda stamp: anchor_wall + self.elapsed_s(anchor, stamp)


class EventPair:
    """A start/stop pair on the device's stream: ``start()``, work, ``stop()``, ``elapsed_s()``."""

    def __init__(self, clock: DeviceClock):
        self.clock, self._start, self._stop = clock, None, None

    def start(self) -> "EventPair":
        self._start, self._stop = self.clock.stamp(), None
        return self

    def stop(self) -> "EventPair":
        if self._start is None:
            raise RuntimeError("EventPair.stop before start")
        self._stop = self.clock.stamp()
        return self

    def elapsed_s(self) -> float:
        """Device seconds between start and stop; synchronizes on the stop event."""
        if self._stop is None:
            raise RuntimeError("EventPair.elapsed_s before stop")
        return self.clock.elapsed_s(self._start, self._stop)
