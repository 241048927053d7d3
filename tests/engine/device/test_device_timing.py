"""The device timing API (engine/device/clock.py): the CPU path for real, and on CUDA the documented
event protocol (record on the current stream, synchronize the later event, elapsed_time in ms)
checked with a stand-in event, since no GPU is available to the test suite."""
from __future__ import annotations

import time

import pytest
import torch

from engine.device.clock import DeviceClock, EventPair


def test_cpu_clock_times_work_and_maps_to_wall_seconds():
    clock = DeviceClock("cpu")
    with pytest.raises(RuntimeError, match="anchor"):
        clock.wall(clock.stamp())
    clock.anchor()
    before = time.time()
    a = clock.stamp()
    time.sleep(0.05)
    b = clock.stamp()
    assert 0.05 <= clock.elapsed_s(a, b) < 0.5
    assert before - 0.01 <= clock.wall(a) <= clock.wall(b) <= time.time() + 0.01
    timebase = clock.timebase()
    clock.anchor()  # a later anchor does not move stamps read through the earlier timebase
    assert timebase(b) == pytest.approx(clock.wall(b), abs=0.01)
    pair = EventPair(clock)
    with pytest.raises(RuntimeError, match="before stop"):
        pair.start().elapsed_s()
    pair.start()
    time.sleep(0.02)
    assert 0.02 <= pair.stop().elapsed_s() < 0.5
    with pytest.raises(ValueError, match="device type"):
        DeviceClock("tpu")


class FakeEvent:
    """Stands in for torch.cuda.Event: records order, answers elapsed_time in milliseconds."""
    log: list = []
    t = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.at = None

    def record(self, stream=None):
        FakeEvent.t += 1.0
        self.at = FakeEvent.t
        FakeEvent.log.append(("record", self.at))

    def synchronize(self):
        FakeEvent.log.append(("synchronize", self.at))

    def elapsed_time(self, end):
        return (end.at - self.at) * 250.0  # ms


def test_cuda_path_records_events_and_converts_milliseconds(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: FakeEvent.log.append(("device",)))
    FakeEvent.log.clear()
    clock = DeviceClock("cuda")
    clock.anchor()
    a, b = clock.stamp(), clock.stamp()
    assert clock.elapsed_s(a, b) == 0.25  # 250 ms
    assert FakeEvent.log[0] == ("device",) and ("synchronize", b.at) in FakeEvent.log
    assert clock.wall(b) - clock.wall(a) == pytest.approx(0.25)
