"""Host waits counted as a GPU or NPU sees them (engine/device/sync_ops.py, syncs.py): every kind
of waiting op is named, each wait once; the same ops with their sizes given (``output_size``, a
histogram's range) and the device-side counting that replaces ``bincount`` are not counted; a
tensor made from host data counts only when it is made for the device; the CUDA runtime's
synchronizing-operation warnings become counts (the runtime itself cannot run here: its mode
switch is stood in for, the warning is the runtime's text)."""
from __future__ import annotations

import warnings

import pytest
import torch

from engine.device.clock import DeviceClock, counter_for
from engine.device.native_syncs import SYNC_WARNING, cuda_sync_warnings
from engine.device.syncs import SyncCounter


def _names(fn, **kw) -> list[str]:
    counter = SyncCounter(strict=True, **kw)
    with counter.step(), counter.watching():
        fn()
    return [e.name for e in counter.last]


def test_each_waiting_op_is_named_once():
    x = torch.randn(6, 4)
    mask, idx = x[:, 0] > 0, torch.tensor([0, 2, 1])
    cases = {
        "aten.bincount": lambda: torch.bincount(idx, minlength=4),
        "boolean-mask indexing": lambda: x[mask],
        "aten.nonzero": lambda: torch.where(mask),
        "aten.repeat_interleave without output_size":
            lambda: torch.arange(2).repeat_interleave(torch.tensor([1, 2])),
        "aten.unique": lambda: torch.unique(idx),
        "aten.masked_select": lambda: x.masked_select(mask[:, None]),
        "aten.histc with its range from the data": lambda: torch.histc(x),
        "aten.equal": lambda: torch.equal(x, x),
        "tensor.item": lambda: x.sum().item(),          # the patched method, not also the op
        "tensor.tolist": lambda: idx.tolist(),
        "torch.tensor from host data": lambda: torch.tensor([1, 2], device="cpu"),
        "tensor.new_tensor from host data": lambda: x.new_tensor([3.0]),
    }
    for name, fn in cases.items():
        assert _names(fn) == [name], name

    def masked_write():
        y = x.clone()
        y[mask] = 0.0
    assert _names(masked_write) == ["boolean-mask indexing"]


def test_the_same_work_with_known_sizes_waits_for_nothing():
    x, idx = torch.randn(6, 4), torch.tensor([0, 2, 1, 2])

    def known():
        torch.arange(2).repeat_interleave(torch.tensor([1, 2]), output_size=3)
        torch.histc(x, 4, -1.0, 1.0)
        torch.zeros(4, dtype=torch.long).scatter_add_(0, idx, torch.ones_like(idx))  # counts
        torch.sort(idx, stable=True)
        torch.tensor([1, 2])                       # host data for the host
        torch.full((3,), 2.0)
        x.index_select(0, idx)
    assert _names(known) == []


def test_host_data_counts_for_the_run_device_only():
    # a CUDA run's counter (native report) does not classify ops; an NPU run's counts copies to npu
    assert _names(lambda: torch.tensor([1.0], device="cpu"), device_type="npu") == []
    assert counter_for("cpu").strict and counter_for("npu").strict
    assert counter_for("cuda").native is cuda_sync_warnings and not counter_for("cuda").strict
    assert DeviceClock("cpu").syncs.strict


def test_cuda_warnings_become_counts(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    counter = SyncCounter(native=cuda_sync_warnings, device_type="cuda")
    with counter.step(), counter.watching():
        for _ in range(2):  # every occurrence, not once per place
            warnings.warn(f"called a {SYNC_WARNING}", UserWarning)
        with counter.ignored():  # a wait the engine counts itself
            warnings.warn(f"called a {SYNC_WARNING}", UserWarning)
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else", UserWarning)
    assert [e.name for e in counter.last] == ["cuda synchronizing operation"] * 2
    assert modes == ["warn", 0]  # set for the block, restored after


def test_a_device_run_does_not_count_reads_of_host_tensors():
    """torch's foreach AdamW (the engine's AdamW where no fused kernel exists: the NPU) keeps each
    parameter's step count on the host and reads it with ``item``: on a device's run that waits
    for nothing, so a counter for an NPU run counts none of it; for a CPU run, where every tensor
    stands for a device tensor, the same reads count."""
    def adam_step(device_type: str) -> list:
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
        opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
        for p in params:
            p.grad = torch.ones(3)
        opt.step()                                   # the state exists: step counts on the host
        counter = SyncCounter(strict=True, device_type=device_type)
        with counter.step(), counter.watching():
            opt.step()
            torch.tensor(2.0).item()                 # a host scalar read
        return counter.last

    assert adam_step("npu") == []
    assert len(adam_step("cpu")) >= 5               # 4 parameters' steps (at least) and the read


class _DeviceEvent:
    """Stands in for a CUDA/NPU event (none exists on this CPU): ``synchronize`` is the host's
    wait for it."""

    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


@pytest.mark.parametrize("device_type,strict", [("cuda", False), ("npu", True)])
def test_a_device_run_counts_the_hosts_waits_on_events(device_type, strict):
    """The MoE split sizes' read under expert parallelism waits on the copy's event and then
    reads a pinned host tensor; the offloaded optimizer waits on each bucket's arrival event.
    Neither a tensor method nor CUDA's own report sees an event wait: ``streams.synchronize``
    reports it to the counter, once per wait (the read of the host tensor after it is not one)."""
    from parallel.expert_parallel.host_read import PendingRead
    from parallel.runtime import streams
    native = _DeviceEvent()
    done = streams.Event(streams.Stream("moe host read", torch.device("cpu")), native)
    counter = SyncCounter(strict=strict, device_type=device_type)
    with counter.step(), counter.watching():
        assert PendingRead(torch.tensor([3, 1]), done, "cpu").values() == [3, 1]
        streams.synchronize(streams.Event(done.stream, _DeviceEvent()))   # an offload bucket
    assert native.waits == 1
    assert [e.name for e in counter.last] == ["event.synchronize"] * 2
    # outside a watching counter the same wait is nobody's count
    streams.synchronize(done)
    assert counter.outside == 0 and native.waits == 2
