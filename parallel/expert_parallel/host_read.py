"""The one host read of an MoE layer under expert parallelism: the split sizes an all-to-all (or
the allgather dispatcher's row count) needs on the host, copied as Megatron-Core does.

``HostReader.start(values)`` queues a copy of a small integer tensor to pinned host memory on a
side stream (``parallel.runtime.streams``: "moe host read"), ordered after the work that produced it
and non-blocking for the compute stream, and returns a ``PendingRead``; the layer goes on queueing
device work (the permutation of its rows) and calls ``PendingRead.values()`` at the latest point,
right before the collective that takes the host lists: the host waits there once, for the copy
alone. On the CPU (and the dry run's meta device) there is no stream: ``values()`` reads the
tensor itself, which the step's wait counter counts just the same (``tolist``: one wait).

One reader serves a whole model: the MoE layers built from one ``models.layers.LayerContext``
share its ``host_reader``, whose side stream per device is made on first use. A stream per layer
would take one of the device's pooled streams per MoE layer (torch hands its 32 low-priority pool
streams out round-robin, and ProcessGroupNCCL takes its communicators' streams from the same
pool), so with a few dozen layers a layer's copy could share a stream with a communicator and
queue behind unrelated collectives; the reader's one stream is a high-priority one
(``streams.side_stream(..., high_priority=True)``), from the pool no communicator takes, so it
shares with none, and the scheduler runs its short copy ahead of queued compute. Nothing is module
state.

Under ``torch.compile`` the read is a graph break: ``HostReader.start`` runs eagerly
(``torch.compiler.disable``: the stream context, the event and the pinned non-blocking copy are not
traced), and the integers the read returns decide the row count of every tensor after it. A
dispatcher therefore consumes them in an eager island (``torch.compiler.disable``: the read, the
slices and collectives sized by it) and hands the compiled code after it tensors whose row
dimension ``dynamic_rows`` has marked dynamic: the graphs after the read compile once, for every
row count, instead of once for the first step's counts and again, dynamic, when they change
(Dynamo's default for a size it saw only once). The split sizes never enter a graph as constants,
so no guard on them recompiles a graph either.
"""
from __future__ import annotations

import torch

from parallel.runtime import streams

STREAM_NAME = "moe host read"


class PendingRead:
    """A copy in flight to host memory; ``values()`` waits for it and returns the integers."""

    def __init__(self, host: torch.Tensor, done=None, device=None):
        self.host, self.done, self.device, self._values = host, done, device, None

    def values(self) -> list[int]:
        if self._values is None:
            if self.done is not None:
                # the compute stream's later reads of the copy come after it
                streams.wait_event(self.done, streams.current_stream(self.device))
                streams.synchronize(self.done)          # the host's one wait (counted there)
            self._values = [int(v) for v in self.host.tolist()]
        return self._values


class HostReader:
    """Pinned, non-blocking device-to-host copies on one side stream per device (shared by every
    MoE layer of a model: ``LayerContext.host_reader``)."""

    def __init__(self):
        self._streams: dict[torch.device, streams.Stream] = {}

    def stream(self, device) -> streams.Stream:
        """The side stream this reader copies on from ``device``, made on first use."""
        device = torch.device(device)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = streams.side_stream(STREAM_NAME, device,
                                                               high_priority=True)
        return side

    @torch.compiler.disable  # eager under torch.compile: streams, events and a pinned copy
    def start(self, values: torch.Tensor) -> PendingRead:
        """Begin reading ``values`` (1-D, integers) on the host."""
        device = values.device
        if device.type in ("cpu", "meta"):
            return PendingRead(values)
        side = self.stream(device)
        ready = streams.record_event(streams.current_stream(device))  # after the values' producer
        with streams.use(side):
            streams.wait_event(ready, side)
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            streams.record_stream(values, side)      # values may be freed before the copy ran
            done = streams.record_event(side)
        return PendingRead(host, done, device)


def dynamic_rows(*tensors: torch.Tensor) -> None:
    """Mark dim 0 of each tensor (rows whose number the host read decided) dynamic for the
    compiled graphs that take it: no graph is first specialised to one step's row count."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
