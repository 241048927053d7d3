"""Contiguous gradient buffers, their buckets and (ZeRO) the parameters' own flat buffers.

Each parameter's gradient lives in ``param.main_grad``, a view into one flat buffer (fp32 by
default, whatever the parameter dtype), so micro-batch accumulation happens in full precision and a
whole bucket is handed to one collective without packing. Parameters are laid out in reverse
registration order, the order in which backward produces their gradients, so buckets fill from the
front of the buffer and can be reduced while backward is still running on earlier layers.

A buffer holds parameters of one (parameter dtype, compressor) pair; buckets are closed once they
reach the configured size (a parameter is never split) and padded to a multiple of
``pad_multiple`` (a multiple of dp), so every bucket divides into equal per-rank shards for
reduce-scatter (ZeRO) over the group the bucket is summed over (an expert bucket: the
expert-data-parallel group, whose size divides dp)::

    buffer:  | bucket 0: p9 p8 p7 pad | bucket 1: p6 p5 pad | ... |
    shard r of bucket b: [b.start + r * b.numel / dp, b.start + (r + 1) * b.numel / dp)

ZeRO-2 (``GradBuffer.release(world)``) drops the flat buffer: each bucket then owns a
persistent fp32 ``shard`` (numel / dp) that receives the reduce-scatter, and a full-size
``storage`` that exists only from the bucket's first gradient of a step until its reduction is done
(``Bucket.ensure_storage`` / ``Bucket.free_storage``); ``param.main_grad`` is None in between.

``bind_param_buffer`` (ZeRO-1/2) gives the parameters of a buffer one flat tensor of their dtype
with the gradient buffer's layout, so the updated shards are all-gathered straight into the
parameters. Under ZeRO-3 (``unit_of``) a bucket never holds parameters of two gather units
(parallel/dp/zero3_units.py), so each unit's buckets can be gathered and freed on their own, and
the buffer may be built ``deferred``: no flat gradient at all, only the shards ``release`` makes
(the full gradient of a TP x PP shard never exists at once).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.runtime import streams
from parallel.dp.compression import Compressor
from parallel.dp.policy import CompressorSpec


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter's gradient sits in its buffer: data[start:end] == main_grad.view(-1)."""
    name: str
    param: torch.nn.Parameter
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class Bucket:
    """A padded, contiguous range of one buffer that is reduced by one collective exchange."""
    buffer: "GradBuffer"
    start: int
    end: int
    slots: list[ParamSlot]
    index: int = -1                       # launch order over all buffers, set by the reducer
    compressor: Compressor | None = None  # built per bucket: residuals are per bucket
    storage: torch.Tensor | None = None   # ZeRO-2: the full gradient while the step needs it
    shard: torch.Tensor | None = None     # ZeRO-2: this rank's reduced fp32 shard (persistent)
    compressed_step: bool = False         # whether this step's exchange went through the compressor
    variance: object = None               # sparse compressors: this rank's LocalVariance (variance.py)
    group: object = None                  # the group it is summed over (None: the reducer's DP x CP)
    exchange_group: object = None         # that group on the exchange worker's lane (compression)
    shard_rank: int = 0                   # ZeRO: this rank's shard among the group's shard_world
    shard_world: int = 1

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def data(self) -> torch.Tensor:
        """The bucket's full gradient (ZeRO-2: only between ensure_storage and free_storage)."""
        if self.buffer.data is not None:
            return self.buffer.data[self.start:self.end]
        if self.storage is None:
            raise RuntimeError(f"bucket {self.index}: its ZeRO-2 gradient storage is not allocated")
        return self.storage

    @property
    def spec(self) -> CompressorSpec:
        return self.buffer.spec

    @property
    def param_dtype(self) -> torch.dtype:
        return self.buffer.param_dtype

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """Absolute buffer range of ``rank``'s 1/world shard of this bucket."""
        size = self.numel // world
        return self.start + rank * size, self.start + (rank + 1) * size

    def own_range(self) -> tuple[int, int]:
        """Absolute buffer range of this rank's ZeRO shard (over the bucket's own group)."""
        return self.shard_range(self.shard_rank, self.shard_world)

    def own_view(self) -> torch.Tensor:
        """This rank's reduced gradient shard over the bucket's own group (``shard_view``)."""
        return self.shard_view(self.shard_rank, self.shard_world)

    def shard_view(self, rank: int, world: int) -> torch.Tensor:
        """This rank's reduced gradient shard: a view into the buffer, or the ZeRO-2 shard."""
        if self.shard is not None:
            return self.shard
        s, e = self.shard_range(rank, world)
        return self.buffer.data[s:e]

    # ---- ZeRO-2 storage ------------------------------------------------------------------------
    def ensure_storage(self) -> None:
        """Allocate the zeroed full gradient of this bucket and point main_grad into it."""
        if self.buffer.data is not None or self.storage is not None:
            return
        device = self.shard.device
        self.storage = torch.zeros(self.numel, dtype=self.buffer.grad_dtype, device=device)
        for slot in self.slots:
            slot.param.main_grad = self.storage[slot.start - self.start:slot.end - self.start] \
                .view_as(slot.param)

    def free_storage(self, used_on: streams.Stream | None = None) -> None:
        """Drop the ZeRO-2 full gradient. ``used_on``: a stream other than the one that allocated
        it whose queued work may still read it; the caching allocator (CUDA, NPU) is told
        (``record_stream``), so the block is reused only once that work is done. The release goes
        through parallel/runtime/streams.py, where the stream-order checker sees it."""
        if self.buffer.data is not None:
            return
        if self.storage is not None:
            streams.record_stream(self.storage, used_on)
            streams.released(self.storage)
        self.storage = None
        for slot in self.slots:
            slot.param.main_grad = None


@dataclass(eq=False)
class GradBuffer:
    """One flat gradient tensor for parameters sharing a dtype and a compressor."""
    named_params: list[tuple[str, torch.nn.Parameter]]   # in backward (reverse) order
    spec: CompressorSpec
    grad_dtype: torch.dtype = torch.float32
    bucket_numel: int = 1 << 22
    pad_multiple: int = 1
    unit_of: dict | None = None           # param -> its gather unit (ZeRO-3): buckets end at units
    device: torch.device | None = None    # where the gradients live (default: the parameters')
    deferred: bool = False                # no flat buffer: the buckets' shards come from release()
    data: torch.Tensor | None = field(init=False)
    buckets: list[Bucket] = field(init=False)

    def __post_init__(self) -> None:
        if not self.named_params:
            raise ValueError("GradBuffer: no parameters given")
        if self.bucket_numel < 1 or self.pad_multiple < 1:
            raise ValueError(f"GradBuffer: bucket_numel ({self.bucket_numel}) and pad_multiple "
                             f"({self.pad_multiple}) must be positive")
        dtypes = {p.dtype for _, p in self.named_params}
        if len(dtypes) != 1:
            raise ValueError(f"GradBuffer: parameters of one buffer must share a dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.device = torch.device(self.device or self.named_params[0][1].device)
        unit = (self.unit_of or {}).get
        layout, slots, start, offset = [], [], 0, 0
        for name, param in self.named_params:
            if slots and (offset - start + param.numel() > self.bucket_numel
                          or unit(param) != unit(slots[-1].param)):
                offset = self._padded(start, offset)
                layout.append((start, offset, slots))
                slots, start = [], offset
            slots.append(ParamSlot(name, param, offset, offset + param.numel()))
            offset += param.numel()
        offset = self._padded(start, offset)
        layout.append((start, offset, slots))
        self.numel = offset
        self.buckets = [Bucket(self, s, e, sl) for s, e, sl in layout]
        self.data = None if self.deferred else \
            torch.zeros(offset, dtype=self.grad_dtype, device=self.device)
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.main_grad = None if self.data is None else \
                    self.data[slot.start:slot.end].view_as(slot.param)

    def _padded(self, start: int, end: int) -> int:
        size = end - start
        return start + -(-size // self.pad_multiple) * self.pad_multiple

    @property
    def slots(self) -> list[ParamSlot]:
        return [s for b in self.buckets for s in b.slots]

    def release(self, world: int) -> None:
        """ZeRO-2/3: free the flat buffer (if any); every bucket keeps a persistent 1/world fp32
        shard."""
        if self.buckets[0].shard is not None:
            return
        self.data = None
        for bucket in self.buckets:
            bucket.shard = torch.zeros(bucket.numel // world, dtype=self.grad_dtype,
                                       device=self.device)
            bucket.free_storage()


def bind_param_buffer(buffer: GradBuffer) -> torch.Tensor:
    """Move the parameters of ``buffer`` into one flat tensor of their dtype laid out like the
    gradient buffer (padding zeroed) and return it; ``param.data`` becomes a view into it."""
    first = buffer.named_params[0][1]
    flat = torch.zeros(buffer.numel, dtype=buffer.param_dtype, device=first.device)
    for slot in buffer.slots:
        view = flat[slot.start:slot.end].view_as(slot.param)
        view.copy_(slot.param.detach())
        slot.param.data = view
    return flat
