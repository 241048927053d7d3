"""What one rank's run of a schedule returns (``PipelineResult``), and the host clock that times it
on a CPU without a device clock (``HostClock``); parallel/pipeline/executor.py fills them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from parallel.pipeline.timeline import TimelineEvent
from parallel.pipeline.transfers import TransferSpan


class HostClock:
    """``time.perf_counter`` stamps: the device's own time on CPU only (see DeviceClock)."""

    def __init__(self) -> None:
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    def stamp(self) -> float:
        return time.perf_counter()

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start

    def wall(self, stamp: float) -> float:
        return self._wall0 + stamp - self._perf0

    def timebase(self):
        return self.wall


@dataclass
class PipelineResult:
    loss_values: torch.Tensor | None  # last stage: forward_step's value per micro-batch, (m,) on
                                      # the device (reading it is a host sync); else None
    peak_in_flight: int            # most (micro-batch, chunk) activations held at once
    marks: list = field(repr=False, default_factory=list)  # (name, cat, start, end, micro, chunk)
    wall: object = field(repr=False, default=None)  # stamp -> epoch seconds (clock.timebase())
    rank: int = 0
    spans: list = field(repr=False, default_factory=list)  # (kind, start, end, action indices)
    _events: list | None = field(repr=False, default=None)

    @property
    def transfer_spans(self) -> list[TransferSpan]:
        """This rank's posts and waits of transfers in wall seconds (parallel/pipeline/transfers.py),
        each naming the indices of its actions in the rank's program."""
        wall = self.wall
        return [TransferSpan(kind, wall(a), wall(b), indices) for kind, a, b, indices in self.spans]

    @property
    def events(self) -> list[TimelineEvent]:
        """This rank's actions as TimelineEvents in wall seconds (resolved once, on first read)."""
        if self._events is None:
            wall = self.wall
            self._events = [TimelineEvent(self.rank, name, cat, wall(a), wall(b), micro, chunk)
                            for name, cat, a, b, micro, chunk in self.marks]
        return self._events

    @property
    def wait_s(self) -> float:
        """Device time spent in transfers (posting and waiting for receives and sends)."""
        return sum(e.end - e.start for e in self.events if e.cat == "comm")

    @property
    def losses(self) -> list[float]:
        """The micro-batch losses on the host (one device sync), empty off the last stage."""
        return [] if self.loss_values is None else self.loss_values.float().tolist()

    @property
    def loss_sum(self) -> torch.Tensor | None:
        """Sum of the micro-batch losses as a 0-d device tensor (no sync), None off the last stage."""
        return None if self.loss_values is None else self.loss_values.float().sum()

    @property
    def loss(self) -> float | None:
        """Sum of the micro-batch losses: the step's mean loss when they were pre-divided by m."""
        return sum(self.losses) if self.loss_values is not None else None
