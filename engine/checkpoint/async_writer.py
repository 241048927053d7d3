"""Checkpoints at step boundaries, written synchronously or (``--async-save``) in the background.

With ``async_save`` a save blocks training only while this rank's tensors are copied to host memory
(``writer.snapshot`` into ``HostBuffers``, reused by every save). A background thread then writes
the rank's safetensors file, re-reads it against its sha256 and writes the rank's JSON description:
file I/O only. The thread never issues a collective (a second thread's collectives would race with training's on the same
process groups, and are illegal on NCCL/HCCL streams).

Completion is agreed by the main thread at the following step boundaries, from four counters
summed over all ranks::

    [ranks asking to stop (SIGTERM or SIGINT), ranks asking because of SIGINT, ranks whose part
     of the save in flight is written and verified, ranks whose background write failed]

They ride on the step's statistics all-reduce (``counts``, a source of engine/training/step.py's
``StepAgreement``, sampled when the step's gradients are checked), so a training step costs no
collective of its own here; a boundary without them (a caller that runs no step) issues one int32
all-reduce (``agree``) instead.

When the third counter reaches the world size, rank 0 publishes the save with the synchronous
path's own ``publish`` (merge the index, rename ``iter_X.tmp``, repoint ``latest``), after the
metrics record of the saved step, written at the step after it, is fsynced (``before_publish``:
a run resumed from ``latest`` finds the records of every step up to it); until then the
previous checkpoint stays the one ``latest`` names, so a crash during the background write loses
nothing that was published. Every rank then agrees on the publication's outcome, as the
synchronous path does (``writer.publish_agreed``: one all-gather, at boundaries that publish only): a
failed ``publish`` (a full disk) is the same CheckpointError on every rank. At most one save is
in flight: a save that comes due while the previous one is still being written, the run's last
step and an agreed stop all wait for it first. Example, ``--save-interval 2`` on 2 ranks::

    boundary 2: [0, 0, 0, 0]  snapshot of step 2, writer threads start   (save_blocking_s: the copy)
    boundary 3: [0, 0, 1, 0]  rank 1 is done, rank 0 still writing
    boundary 4: [0, 0, 2, 0]  both done: rank 0 publishes iter_0000002; snapshot of step 4 ...

The stop counter rides on the same all-reduce so that all ranks stop after the same step, even when
SIGTERM (or Ctrl-C's SIGINT) reaches them on either side of a boundary.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.checkpoint.index import CheckpointError
from engine.checkpoint.writer import (Snapshot, before_publish, prepare_dir, publish_agreed,
                                      save_checkpoint, snapshot, unchanged_since_load, write_files)
from parallel.dp.host_flat import HostFlat
from parallel.runtime import streams


def agree(ps, counts: list[int]) -> list[int]:
    """The one collective here: an int32 SUM of ``counts`` over all ranks, from the main thread, on
    ``ps.world_group`` (so the backend rules, the lane and order checks and the counters see it)."""
    if ps.world_size == 1 or not dist.is_initialized():
        return list(counts)
    t = torch.tensor(counts, dtype=torch.int32, device=ps.device)
    ps.world_group.all_reduce(t)
    return [int(v) for v in t.tolist()]


def packing(numels: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The order in which tensors of ``numels`` elements lie in their chunks, the largest first
    (the chunks fill better), and their (offset, length) entries in that order."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i])
    entries, offset = [], 0
    for i in order:
        entries.append((offset, numels[i]))
        offset += numels[i]
    return order, entries


class HostBuffers:
    """Host tensors that every background save of this run copies into, one save at a time.

    Reusing them matters on the CPU: a fresh 1 GiB tensor costs about four times the copy itself
    in first-touch page faults (measured here: 0.8-0.9 s against 0.15-0.23 s), so only the first
    save pays for the allocation. They hold one copy of what this rank writes for the whole run.
    On an accelerator the buffers of device tensors are pinned and every copy is asynchronous: the
    snapshot queues all of them on the compute stream, ``ready()`` records one event after the
    last, and the writer thread waits for that event (``streams.synchronize``) before it reads
    them; a pageable copy would make the host wait for each tensor in turn. The pinned buffers
    are views into chunks of whole tensors, one ``HostFlat`` per dtype (parallel/dp/host_flat.py):
    CUDA's and torch_npu's caching host allocators round every pinned allocation up to a power of
    two, which one buffer per tensor would pay on each (a 112 MiB weight pins 128 MiB, a ZeRO
    shard's moments anything up to twice their size: 14% over the bf16 weights of the 8B llama of
    docs/benchmarks.md); chunks of whole tensors, the largest first, 1.5% (the test): the rounding
    falls on each dtype's last chunk alone (on the CPU the chunks are not pinned). On an accelerator a tensor
    already in host memory (the offloaded optimizer's state) gets a pageable buffer of its own: its
    copy is the host's own, and pinned memory is scarce beside the offload. The buffers are laid
    out at the first save and kept while the tensors a save writes keep their names, shapes and
    dtypes (another layout frees them first)."""

    def __init__(self, device="cpu", chunk_bytes: int | None = None):
        self.device = torch.device(device)
        self.pinned = self.device.type not in ("cpu", "meta")
        self.chunk_bytes = chunk_bytes
        self._bufs: dict[str, torch.Tensor] = {}
        self._flats: list[HostFlat] = []
        self._pageable: list[torch.Tensor] = []
        self._layout: tuple = ()

    def pins(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s host buffer is pinned: on an accelerator, for a device tensor."""
        return self.pinned and t.device.type != "cpu"

    def take(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (name -> tensor, views of the live state), in this object's
        buffers: copies queued on the device for device tensors, the host's own for host ones."""
        layout = tuple((k, tuple(t.shape), t.dtype, self.pins(t)) for k, t in tensors.items())
        if layout != self._layout:
            self._bufs, self._flats, self._pageable, self._layout = {}, [], [], ()   # freed first
            self._allocate(tensors)
            self._layout = layout
        out = {}
        for key, t in tensors.items():
            buf = self._bufs[key]
            buf.copy_(t.detach(), non_blocking=self.pins(t))
            out[key] = buf
        return out

    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for key, t in tensors.items():
            if self.pinned and not self.pins(t):   # host memory already, on an accelerator
                self._bufs[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                self._pageable.append(self._bufs[key])
            else:   # the device's (on the CPU: every tensor, in unpinned chunks)
                by_dtype.setdefault(t.dtype, []).append((key, t))
        for dtype, group in by_dtype.items():
            order, entries = packing([t.numel() for _, t in group])
            flat = HostFlat(entries, dtype, pin=self.pinned, chunk_bytes=self.chunk_bytes)
            self._flats.append(flat)
            for i, (start, n) in zip(order, entries):
                key, t = group[i]
                self._bufs[key] = flat[start:start + n].view(t.shape)

    def allocated_bytes(self) -> tuple[int, int]:
        """(bytes in chunks, bytes in buffers of their own), as requested from the allocators."""
        chunks = sum(f.allocated_bytes() for f in self._flats)
        own = sum(b.numel() * b.element_size() for b in self._pageable)
        return chunks, own

    def ready(self) -> streams.Event:
        """An event after every copy queued so far (on the current stream)."""
        return streams.record_event(streams.current_stream(self.device))


class _Flight:
    """One save being written by a background thread (parallel.runtime.streams.start_thread: it
    binds the rank's device, and the stream-order checker orders the next copy into the host buffers
    after the thread's reads only through ``join`` or ``finished``)."""

    def __init__(self, snap: Snapshot, device, copied: streams.Event | None = None):
        self.snap, self.error, self.copied = snap, None, copied
        self.thread = streams.start_thread(f"gridtron-save-{snap.step}", self._run, device)

    def _run(self) -> None:
        try:
            if self.copied is not None:   # the host copies are complete (pinned, asynchronous)
                streams.synchronize(self.copied)
            write_files(self.snap, verify=True)
        except BaseException as exc:  # noqa: BLE001 - reported at the next step boundary
            self.error = exc
        finally:
            self.snap.tensors = {}  # release the host copies

    def counts(self) -> list[int]:
        """(written and verified, failed) for this rank, as of now."""
        if not self.thread.finished():
            return [0, 0]
        return [0, 1] if self.error is not None else [1, 0]


@dataclass
class Boundary:
    stop: bool                 # every rank stops after this step (some rank got SIGTERM/SIGINT)
    published: str | None      # the checkpoint published at this boundary, if any
    blocking_s: float | None   # time spent here on checkpoints; None when there was nothing to do
    by: str | None = None      # what stopped the run: "SIGINT" when any rank got it, else "SIGTERM"


class Checkpointer:
    """Decides at each step boundary whether to poll, publish, wait for or start a save."""

    def __init__(self, trainer):
        self.trainer, self.ps = trainer, trainer.ps
        ck = trainer.cfg.checkpoint
        self.save_dir, self.background = ck.save, bool(ck.async_save)
        self.flight: _Flight | None = None
        self.buffers = HostBuffers(self.ps.device)

    def counts(self) -> list[int]:
        """This rank's [stop requested, by SIGINT, save in flight written, save in flight failed],
        for the step's agreement (engine/training/step.py StepAgreement)."""
        mine = self.flight.counts() if self.flight is not None else [0, 0]
        return [*self._stops(), *mine]

    def _stops(self, requested: bool | None = None) -> list[int]:
        """[stop requested, by SIGINT] of this rank (``requested``: whether it asks, else from the
        trainer's ``stop_signal``)."""
        sig = getattr(self.trainer, "stop_signal", None)
        stop = sig is not None if requested is None else requested
        return [int(stop), int(stop and sig == signal.SIGINT)]

    def boundary(self, step: int, due: bool, stop_requested: bool = False, last: bool = False,
                 agreed: list[int] | None = None) -> Boundary:
        """After optimizer step ``step`` (1-based): ``due`` when the save interval says so,
        ``last`` on the run's last step; ``stop_requested`` when this rank received SIGTERM or
        SIGINT.
        ``agreed``: the step's sums of ``counts()`` over all ranks (then ``stop_requested`` was
        part of them); without them the counters are all-reduced here."""
        t0 = time.perf_counter()
        worked = self.flight is not None
        if agreed is not None:
            stops, interrupts, done, failed = agreed
        else:
            mine = self.flight.counts() if self.flight is not None else [0, 0]
            stops, interrupts, done, failed = agree(self.ps, [*self._stops(stop_requested), *mine])
        published = self._conclude(done, failed)
        stop = stops > 0
        if (stop or last) and self.flight is not None:
            published = self.wait()
        if self.save_dir and (due or stop or last) and not unchanged_since_load(self.trainer, step):
            worked = True
            if self.background and not (stop or last):
                self.start(step)
            else:  # the run ends here: nothing to overlap with
                published = save_checkpoint(self.trainer, step, t0, ending=stop or last)
        by = ("SIGINT" if interrupts else "SIGTERM") if stop else None
        return Boundary(stop, published, time.perf_counter() - t0 if worked else None, by)

    def start(self, step: int) -> None:
        """Wait for the save in flight, copy this rank's state to host memory, start the writer."""
        if self.flight is not None:
            self.wait()
        tmp = prepare_dir(self.trainer, step)
        # one copy thread: with the host's cores shared, intra-op copy threads wait on each other
        # (measured here under load: 1 GB in 0.11-0.19 s with one thread, 0.4-1.4 s with two)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            snap = snapshot(self.trainer, step, tmp)
            snap.tensors = self.buffers.take(snap.tensors)
        finally:
            torch.set_num_threads(threads)
        self.flight = _Flight(snap, self.ps.device, self.buffers.ready())

    def wait(self) -> str | None:
        """Block until the save in flight is written on every rank and published; every rank
        returns once it is. Returns the published directory (None when nothing was in flight)."""
        if self.flight is None:
            return None
        self.flight.thread.join()
        _, _, done, failed = agree(self.ps, [0, 0, *self.flight.counts()])
        return self._conclude(done, failed)  # every rank's thread is joined: fails or publishes

    def _conclude(self, done: int, failed: int) -> str | None:
        """Act on the agreed counters: fail on every rank, publish (rank 0), or keep waiting."""
        flight = self.flight
        if flight is None:
            return None
        snap = flight.snap
        if failed:
            self.flight = None
            why = f": {flight.error}" if flight.error is not None else " (see that rank's log)"
            raise CheckpointError(f"the background save of step {snap.step} failed on {failed} of "
                                  f"{self.ps.world_size} ranks{why}; {snap.tmp} is incomplete and "
                                  f"latest still names the previous checkpoint") from flight.error
        if done < self.ps.world_size:
            return None
        before_publish(self.trainer, snap.step)  # its metrics record: written steps ago, fsynced now
        self.flight = None
        # every rank is here at the same boundary (the counters are sums): a failed publication is
        # the same line on all of them, as in a synchronous save
        publish_agreed(self.ps, snap)
        return snap.final
