"""Contiguous gradient buffers and their buckets.

Each parameter's gradient lives in ``param.main_grad``, a view into one flat buffer (fp32 by
default, whatever the parameter dtype), so micro-batch accumulation happens in full precision and a
whole bucket is handed to one collective without packing. Parameters are laid out in reverse
registration order, the order in which backward produces their gradients, so buckets fill from the
front of the buffer and can be reduced while backward is still running on earlier layers.

A buffer holds parameters of one (parameter dtype, compressor) pair; buckets are closed once they
reach the configured size (a parameter is never split) and padded to a multiple of
``pad_multiple`` (a multiple of dp), so every bucket divides into equal per-rank shards for
reduce-scatter (ZeRO-1)::

    buffer:  | bucket 0: p9 p8 p7 pad | bucket 1: p6 p5 pad | ... |
    shard r of bucket b: [b.start + r * b.numel / dp, b.start + (r + 1) * b.numel / dp)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    compressor: Compressor | None = None  # built per bucket: top-k keeps residuals per bucket

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def data(self) -> torch.Tensor:
        return self.buffer.data[self.start:self.end]

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

    def shard_view(self, rank: int, world: int) -> torch.Tensor:
        s, e = self.shard_range(rank, world)
        return self.buffer.data[s:e]


@dataclass(eq=False)
class GradBuffer:
    """One flat gradient tensor for parameters sharing a dtype and a compressor."""
    named_params: list[tuple[str, torch.nn.Parameter]]   # in backward (reverse) order
    spec: CompressorSpec
    grad_dtype: torch.dtype = torch.float32
    bucket_numel: int = 1 << 22
    pad_multiple: int = 1
    data: torch.Tensor = field(init=False)
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
        device = self.named_params[0][1].device
        layout, slots, start, offset = [], [], 0, 0
        for name, param in self.named_params:
            if slots and offset - start + param.numel() > self.bucket_numel:
                offset = self._padded(start, offset)
                layout.append((start, offset, slots))
                slots, start = [], offset
            slots.append(ParamSlot(name, param, offset, offset + param.numel()))
            offset += param.numel()
        offset = self._padded(start, offset)
        layout.append((start, offset, slots))
        self.data = torch.zeros(offset, dtype=self.grad_dtype, device=device)
        self.buckets = [Bucket(self, s, e, sl) for s, e, sl in layout]
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.main_grad = self.data[slot.start:slot.end].view_as(slot.param)

    def _padded(self, start: int, end: int) -> int:
        size = end - start
        return start + -(-size // self.pad_multiple) * self.pad_multiple

    @property
    def slots(self) -> list[ParamSlot]:
        return [s for b in self.buckets for s in b.slots]
