"""ZeRO-3: every bucket's parameters live as this rank's 1/world shard; the whole bucket exists only
while a unit that reads it runs (Megatron-LM's ``--data-parallel-sharding-strategy
optim_grads_params``, FSDP's full shard).

Per bucket ``b`` (the reducer's buckets, which under ZeRO-3 never span two gather units,
buffers.py): ``shards[b]`` is this rank's part of the parameters, of their dtype, persistent (for
fp32 parameters it is the optimizer's master, master.py); ``full[b]`` is the whole bucket, whose
storage is allocated only while gathered. Every parameter of the bucket is a view into ``full[b]``
(``param.data``), so autograd's saved weights, the parameters themselves and every view of them
share that one storage: ``free`` resizes it to zero bytes, and a later ``gather`` resizes it back
and all-gathers the shards into it, so what the forward saved for the backward reads the same
values again. The collective writes through ``full[b]``, a tensor of its own version counter
(``param.data = view`` keeps the parameter's), so no saved tensor's version moves and autograd
accepts the re-gathered storage (the equivalent of ``torch.autograd._unsafe_preserve_version_counter``).

Ordering: a gather is an asynchronous collective on the bucket's group (DP x CP, or EDP for an
expert bucket) issued from the compute stream; ``wait`` orders the compute stream after it before
any read. ``free`` first waits for a gather still in flight (the collective writes the storage),
tells the stream API the storage is released and resizes it away; ``gather`` tells it the storage
is allocated again (``streams.released`` / ``streams.allocated``), so the stream-order checker sees
every free and every reuse (docs/streams.md). Which unit gathers and frees what, and when:
zero3_units.py.

The optimizer (zero.py) reads and writes the shards only: ``own_shard`` is what it updates,
``launch`` takes the updated values after a step (no collective: the next forward gathers), and
``wait_all`` waits for every gather in flight and frees every gathered bucket (before the update,
whose values would otherwise be stale in a gathered copy).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from parallel.runtime import streams

FREE, GATHERING, READY = "free", "gathering", "ready"


def _resize(t: torch.Tensor, numel: int) -> None:
    t.untyped_storage().resize_(numel * t.element_size())


class ShardedParams:
    def __init__(self, reducer, overlap: bool, device=None):
        """Shard every parameter of ``reducer``'s buckets: this rank's shard is kept on
        ``device`` (default: the gradients'), the parameters become views of freed storage.
        ``overlap``: gather asynchronously (and let units prefetch the next unit)."""
        self.reducer, self.overlap = reducer, overlap
        self.group = reducer.group
        self.device = torch.device(device or reducer.buffers[0].device)
        self.buckets = {b.index: b for b in reducer.buckets}
        self.shards: dict[int, torch.Tensor] = {}   # bucket index -> (numel / world,) param dtype
        self.full: dict[int, torch.Tensor] = {}     # bucket index -> (numel,), storage when gathered
        self.state: dict[int, str] = {}
        self._handles: dict[int, object] = {}
        self.on_wait = None                         # test hook: called with the bucket index
        self.on_gather = None                       # test hook: called with the bucket index
        self.clock = None                           # a DeviceClock: each wait is stamped
        self.waited: list = []                      # (start, end) stamps of the waits since cleared
        self.units = None                           # zero3_units.UnitHooks, once registered
        for b in reducer.buckets:
            full = torch.zeros(b.numel, dtype=b.param_dtype, device=self.device)   # (numel,)
            with torch.no_grad():
                for slot in b.slots:
                    view = full[slot.start - b.start:slot.end - b.start].view_as(slot.param)
                    view.copy_(slot.param.detach())
                    slot.param.data = view
            s, e = b.own_range()
            self.shards[b.index] = full[s - b.start:e - b.start].clone()
            self.full[b.index] = full
            self.state[b.index] = READY
            self.free([b.index])

    # ---- what the optimizer uses -----------------------------------------------------------
    def own_shard(self, bucket) -> torch.Tensor:
        """This rank's shard of ``bucket``'s parameters (persistent; fp32: the master)."""
        return self.shards[bucket.index]

    def launch(self, shards) -> None:
        """After an update: ``shards`` are (bucket, this rank's new values in the parameters'
        dtype); values that are not the shard itself are copied into it. No collective: each
        unit gathers its buckets when the next forward reaches it."""
        self.wait_all()
        with torch.no_grad():
            for bucket, values in shards:
                own = self.shards[bucket.index]
                if values.data_ptr() != own.data_ptr():
                    own.copy_(values)

    def wait_all(self) -> None:
        """Wait for every gather in flight and free every gathered bucket."""
        self.free(list(self.state))

    @property
    def pending(self) -> bool:
        return bool(self._handles)

    @property
    def gathered(self) -> list[int]:
        """Indices of the buckets whose storage exists now (gathered or being gathered)."""
        return [i for i, s in self.state.items() if s != FREE]

    def gathered_bytes(self) -> int:
        return sum(self.full[i].numel() * self.full[i].element_size() for i in self.gathered)

    # ---- gather, wait, free ------------------------------------------------------------------
    def gather(self, indices) -> None:
        """Start the all-gather of every free bucket in ``indices`` (in the given order)."""
        for index in indices:
            if self.state[index] != FREE:
                continue
            b, full = self.buckets[index], self.full[index]
            _resize(full, b.numel)
            streams.allocated(full)
            if self.on_gather is not None:
                self.on_gather(index)
            group = b.group or self.group   # an expert bucket: its EDP group
            work = group.all_gather_into(full, self.shards[index], async_op=self.overlap)
            if work is None:
                self.state[index] = READY
            else:
                self._handles[index] = work
                self.state[index] = GATHERING

    def wait(self, indices) -> None:
        """The compute stream waits for the gathers of ``indices`` still in flight."""
        for index in indices:
            work = self._handles.pop(index, None)
            if work is None:
                continue
            if self.on_wait is not None:
                self.on_wait(index)
            start = self.clock.stamp() if self.clock is not None else None
            work.wait()
            if start is not None:   # the step's time_zero_gather_exposed_s
                self.waited.append((start, self.clock.stamp()))
            self.state[index] = READY

    def ensure(self, indices) -> None:
        """Every bucket of ``indices`` gathered and waited for: readable on the compute stream."""
        self.gather(indices)
        self.wait(indices)

    def free(self, indices) -> None:
        """Release the storage of every gathered bucket of ``indices`` (a gather in flight is
        waited for first: its collective writes that storage)."""
        for index in indices:
            if self.state[index] == FREE:
                continue
            self.wait([index])
            full = self.full[index]
            streams.released(full, resized=True)
            _resize(full, 0)
            self.state[index] = FREE

    @contextmanager
    def all_gathered(self):
        """Every bucket gathered inside (for reading whole parameters outside a forward: tests,
        tools); freed again on exit."""
        self.ensure(sorted(self.state, reverse=True))
        try:
            yield self
        finally:
            self.wait_all()

    # ---- hooks ---------------------------------------------------------------------------------
    def register_hooks(self, modules) -> None:
        """The gather units of ``modules`` (the model chunks) and their hooks (zero3_units.py)."""
        from parallel.dp.zero3_units import UnitHooks
        self.units = UnitHooks(self, modules)

    def remove_hooks(self) -> None:
        if self.units is not None:
            self.units.remove()
            self.units = None


def move_buffers(modules, device) -> None:
    """Put the modules' buffers on ``device`` (under ZeRO-3 a model is built on the host and only
    the shards go to the device, so ``Module.to`` must not touch the parameters)."""
    for module in modules.modules() if isinstance(modules, torch.nn.Module) else modules:
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != torch.device(device):
                module._buffers[name] = buf.to(device)
