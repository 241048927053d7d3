"""Flat host vectors of the optimizer offload, held as chunks of whole entries, so that pinned
memory is not rounded up to a power of two.

CUDA's caching host allocator (and torch_npu's) rounds every pinned allocation up to the next
power of two (torch 2.11's ``CachingHostAllocator``: ``PowerOf2Ceil(size)``, with no threshold to
turn it off): one buffer of 25.4 GiB pins 32 GiB. A ``HostFlat`` of ``numel`` elements is instead
a list of chunks filled with whole entries, the (offset, length) ranges the offload addresses
(one bucket's shard each; every slice it takes lies inside one entry). Each chunk but the last
holds a power of two bytes, at most ``CHUNK_BYTES`` and at most what is left, so the allocator
rounds none of them; the last holds exactly what remains. What a chunk leaves unused is less
than its next entry, and the allocator's rounding falls on the last chunk alone, itself no larger
than the chunk before it. An entry larger than ``CHUNK_BYTES`` gets a chunk of its own size,
which the allocator does round up (a bucket's shard is far smaller).

Worked example (4-byte elements, ``chunk_bytes`` 64, so 16 elements a chunk): entries (0, 6),
(6, 6), (12, 6), (18, 3) of 21 elements. The first chunk may hold min(64, 84 rounded down to a
power of two) = 64 bytes, 16 elements: entries 0 and 1 (12), the third does not fit. 9 elements
remain, 36 bytes: the next chunk would hold 32 bytes (8 elements), less than what is left, but the
remaining entries (6 and 3) do not both fit, so it takes entry 2 alone; then 3 elements remain,
12 bytes, and the last chunk holds exactly entry 3. Chunks of 16, 8 and 3 elements:

>>> flat = HostFlat([(0, 6), (6, 6), (12, 6), (18, 3)], torch.float32, pin=False, chunk_bytes=64)
>>> [c.numel() for c in flat.chunks], flat.numel()
([16, 8, 3], 21)
>>> flat[8:12].data_ptr() == flat.chunks[0][8:12].data_ptr(), flat[18:21].shape
(True, torch.Size([3]))
"""
from __future__ import annotations

import bisect

import torch

CHUNK_BYTES = 1 << 32   # 4 GiB: a bucket's shard (25 MB by default) is far smaller: little unused


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def chunk_layout(entries: list[tuple[int, int]], element_size: int,
                 chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """The chunks for ``entries`` ((offset, length) in order, contiguous from 0): (first element,
    capacity in elements) each (module docstring)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    chunks, i = [], 0
    total = sum(n for _, n in entries)
    entries = [(o, n) for o, n in entries if n] if total else []   # (nothing to hold: no chunk)
    while i < len(entries):
        start = entries[i][0]
        left = total - start
        cap = max(min(chunk_bytes, _floor_pow2(left * element_size)) // element_size, entries[i][1])
        used = 0
        while i < len(entries) and used + entries[i][1] <= cap:
            used += entries[i][1]
            i += 1
        chunks.append((start, used if used == left else cap))
    return chunks


class HostFlat:
    """A flat vector of host memory (pinned where ``pin``) addressed by element offsets, held as
    the chunks of ``chunk_layout``; a slice must lie inside one chunk (inside one entry always
    does)."""

    def __init__(self, entries: list[tuple[int, int]], dtype: torch.dtype, pin: bool,
                 chunk_bytes: int | None = None):
        layout = chunk_layout(entries, torch.empty((), dtype=dtype).element_size(),
                              CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
        self.starts = [start for start, _ in layout]
        self.dtype = dtype
        self.chunks = [torch.zeros(cap, dtype=dtype, pin_memory=pin) for _, cap in layout]
        self._numel = sum(n for _, n in entries)
        self.ends = self.starts[1:] + [self._numel]   # chunk c holds elements [starts[c], ends[c])

    def numel(self) -> int:
        return self._numel

    def allocated_bytes(self) -> int:
        """Bytes requested from the allocator (the entries plus each chunk's unused tail)."""
        return sum(c.numel() * c.element_size() for c in self.chunks)

    def __getitem__(self, sl: slice) -> torch.Tensor:
        start = sl.start or 0
        stop = self._numel if sl.stop is None else sl.stop
        if start == stop == self._numel and not self.chunks:
            return torch.zeros(0, dtype=self.dtype)
        c = bisect.bisect_right(self.starts, start) - 1     # the chunk holding ``start``
        if c < 0 or stop > self.ends[c]:
            raise IndexError(f"range [{start}, {stop}) is not inside one chunk of host memory")
        return self.chunks[c][start - self.starts[c]:stop - self.starts[c]]

    def __setitem__(self, sl: slice, value) -> None:
        self[sl].copy_(value)
