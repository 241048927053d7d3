"""Host synchronisations: where the host waits for the device, counted per training step.

A host that waits for its device cannot queue the next kernels meanwhile: the device idles while
the host collates, and collectives queued at the end of a step (ZeRO's parameter all-gathers) are
forced to finish before the next one can start overlapping them. So a step waits exactly once,
where the host needs values it cannot do without (the loss scaler's skip decision and the
clipping coefficient, engine/training/step.py), and reads everything else it reports at that
point or at the next step's.

``SyncCounter`` counts the waits. It always sees the engine's own (``DeviceClock.synchronize``,
an event wait of ``DeviceClock.elapsed_s``, ``DeviceClock.read``); inside ``watching()`` it also
sees the implicit ones made by any code on the step's path, in the thread that entered it:

- ``Tensor.item``, ``bool()``, ``float()``, ``int()``, ``index()`` of a tensor, ``tolist``, and
  ``cpu()`` / ``to("cpu")`` of a device tensor (a blocking copy; ``non_blocking=True`` is not
  one), by patching those ``torch.Tensor`` methods while some counter watches;
- with ``strict`` (the default off CUDA), every op that waits on a GPU or NPU, as a
  ``TorchDispatchMode`` sees it (engine/device/sync_ops.py: scalar reads from C++, ``nonzero``,
  boolean-mask indexing, ``bincount``, ``repeat_interleave`` without ``output_size``, ``unique``,
  blocking copies between host and device), and tensors made from Python data for the device
  (``torch.tensor(data, device=...)``, ``torch.as_tensor(data, device=...)``, ``new_tensor``:
  a pageable host-to-device copy on a GPU), by patching those functions;
- the host's waits on a device event (``parallel.runtime.streams.synchronize``: the MoE split
  sizes' read under expert parallelism, the offloaded optimizer's per-bucket waits), reported
  by ``streams.observing_host_waits`` (neither a tensor method nor CUDA's sync report sees them);
- with ``native`` (CUDA runs), the waits the CUDA runtime itself reports
  (``torch.cuda.set_sync_debug_mode("warn")``, engine/device/native_syncs.py), instead of the
  dispatch mode: exact for the device, and free of the mode's per-op cost.

A wait reached through a patched method counts once, under the method's name. On the CPU every
tensor is the device's: a read of its value (``item``, ``tolist``, ``bool``...) counts, as it would
block on a GPU (on a device, a read of a host tensor waits for nothing and is not counted:
torch's foreach AdamW keeps its step counts on the host and reads each with ``item``), and the
dispatch mode names each op as a GPU would wait for it, so a CPU test
proves the GPU's count (``benchmarks.device_check`` compares the two counts on CUDA). A copy
counts only where there is one (``cpu()`` of a CPU tensor is the tensor itself, and host-side
state such as RNG states is CPU on every device), so CPU tests do not see a ``cpu()`` of what
would be a device tensor on a GPU; a GPU run counts it. Device-to-host reads outside the watched
window (the data pipeline's own host tensors) are not the step's and are not seen. The patch is
installed once per process and dispatches on a thread-local slot, so threads that do not watch
(the checkpoint writer's copies) are not counted and pay one attribute lookup per call. The
dispatch mode costs a few microseconds per op on the host (every op passes through Python): the
price of a CPU or NPU run's ``host_syncs``.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from engine.device.sync_ops import DeviceWaitMode
from parallel.runtime import streams

# torch.Tensor methods that block until the device has produced the value they hand the host
_BLOCKING = ("item", "tolist", "cpu", "to", "__bool__", "__float__", "__int__", "__index__")
# functions that build a tensor from Python data: for the device, a pageable host-to-device copy
_FROM_DATA = (("torch", "tensor"), ("torch", "as_tensor"), ("Tensor", "new_tensor"))
_local = threading.local()         # .counter: the SyncCounter watching in this thread
_originals: dict[str, object] = {}  # name -> torch.Tensor's own method (while patched)
_patch_lock = threading.Lock()
_watchers = 0                      # counters watching in any thread (the patch stays while > 0)


def _copies_to_host(tensor, name: str, args, kwargs) -> bool:
    """``cpu()`` and ``to`` count when they copy a device tensor to the CPU without
    ``non_blocking`` (a blocking copy)."""
    if tensor.device.type == "cpu":
        return False
    if name == "cpu":
        return True
    if kwargs.get("non_blocking") or any(a is True for a in args[1:]):
        return False
    target = kwargs.get("device")
    for a in args[:1]:
        if isinstance(a, (str, torch.device)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    return target is not None and torch.device(target).type == "cpu"


def _wrap(name: str, method):
    def blocking(self, *args, **kwargs):
        counter = getattr(_local, "counter", None)
        if counter is None or counter._inside:
            return method(self, *args, **kwargs)
        if name in ("to", "cpu") and not _copies_to_host(self, name, args, kwargs):
            return method(self, *args, **kwargs)
        if self.device.type == "meta" or (self.device.type == "cpu"
                                          and counter.device_type != "cpu"):
            return method(self, *args, **kwargs)    # (a host tensor of a device's run: no wait)
        counter._inside = True  # a read made of reads (tolist -> item) counts once
        try:
            return method(self, *args, **kwargs)
        finally:
            counter._inside = False
            counter.count(f"tensor.{name.strip('_')}")
    blocking.__name__, blocking.__doc__ = method.__name__, method.__doc__
    return blocking


def _wrap_from_data(owner: str, name: str, fn):
    """``torch.tensor(data, device=D)`` and its kin: counted (strict counters) when the tensor is
    made for the counter's device type from host data."""
    def from_data(*args, **kwargs):
        out = fn(*args, **kwargs)
        counter = getattr(_local, "counter", None)
        if counter is None or counter._inside or not counter.strict:
            return out
        explicit = owner == "Tensor" or kwargs.get("device") is not None
        if explicit and isinstance(out, torch.Tensor) and out.device.type == counter.device_type \
                and not (owner == "torch" and name == "as_tensor" and isinstance(args[0], torch.Tensor)):
            counter.count(f"{owner.lower()}.{name} from host data")
        return out
    from_data.__name__, from_data.__doc__ = getattr(fn, "__name__", name), fn.__doc__
    return from_data


def _patch() -> None:
    global _watchers
    with _patch_lock:
        _watchers += 1
        if _watchers == 1:
            for name in _BLOCKING:
                _originals[name] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _wrap(name, _originals[name]))
            for owner, name in _FROM_DATA:
                holder = torch if owner == "torch" else torch.Tensor
                _originals[f"{owner}.{name}"] = getattr(holder, name)
                setattr(holder, name, _wrap_from_data(owner, name, _originals[f"{owner}.{name}"]))


def _unpatch() -> None:
    global _watchers
    with _patch_lock:
        _watchers -= 1
        if _watchers == 0:
            for key, method in _originals.items():
                owner, _, name = key.rpartition(".")
                setattr(torch if owner == "torch" else torch.Tensor, name, method)
            _originals.clear()


@dataclass
class SyncEvent:
    """One host wait: its name and, when the caller has one, the device clock's stamp of it."""
    name: str
    stamp: object = None


@dataclass
class SyncCounter:
    """Host waits for the device, per step (``begin_step`` / ``end_step``) and outside steps.

        counter = SyncCounter()
        with counter.step():             # or begin_step() ... end_step()
            with counter.watching():     # also the implicit reads of this thread
                ...one training step...
        counter.last                     # the step's waits, e.g. [SyncEvent("statistics", ...)]

    ``strict`` adds the dispatch mode and the host-data copies (every aten op passes through
    Python: a few microseconds each); ``native``, a context manager factory taking the counter,
    adds the device runtime's own report of its waits (CUDA: engine/device/native_syncs.py).
    ``device_type``: the run's device type (whose tensors made from host data are copies).
    """
    strict: bool = False
    native: object = None
    device_type: str = "cpu"
    current: list[SyncEvent] | None = None     # the open step's waits (None between steps)
    last: list[SyncEvent] = field(default_factory=list)   # the last finished step's
    outside: int = 0                           # waits between steps (setup, validation, flush)
    _inside: bool = False

    def count(self, name: str, stamp=None) -> None:
        if self.current is None:
            self.outside += 1
        else:
            self.current.append(SyncEvent(name, stamp))

    def _event_wait(self, name: str) -> None:
        if not self._inside:
            self.count(name)

    def begin_step(self) -> None:
        self.current = []

    def end_step(self) -> list[SyncEvent]:
        self.last, self.current = self.current or [], None
        return self.last

    @contextlib.contextmanager
    def step(self):
        self.begin_step()
        try:
            yield self
        finally:
            self.end_step()

    @contextlib.contextmanager
    def watching(self):
        """Count the implicit host reads of this thread too, until the block ends."""
        if getattr(_local, "counter", None) is not None:  # nested: the outer one counts
            yield self
            return
        _patch()
        _local.counter = self
        mode = DeviceWaitMode(self.count, lambda: not self._inside, self.device_type) \
            if self.strict else contextlib.nullcontext()
        native = self.native(self) if self.native is not None else contextlib.nullcontext()
        try:
            with native, mode, streams.observing_host_waits(self._event_wait):
                yield self
        finally:
            _local.counter = None
            _unpatch()

    @contextlib.contextmanager
    def watching_native(self):
        """The device runtime's report alone (no patched method, no dispatch mode: what a compiled
        step allows)."""
        if self.native is None:
            yield self
            return
        with self.native(self):
            yield self

    @contextlib.contextmanager
    def ignored(self):
        """A read known not to be a device wait (e.g. of host tensors) inside a watched block."""
        inside, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = inside
