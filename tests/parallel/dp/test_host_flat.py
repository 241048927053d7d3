"""parallel/dp/host_flat.py: the optimizer offload's host vectors as chunks of whole entries.

The layout's promises, checked on many random entry lists: every entry inside one chunk, every
chunk but the last a power of two bytes (unless one entry alone is larger), each chunk's unused
tail smaller than the entry that did not fit, and on the 8B model of docs/benchmarks.md (fraction
0.85) the memory a power-of-two host allocator pins within 1% of the state itself, where one
buffer per vector pins 26% more. Slices read and write the chunks' memory.
"""
from __future__ import annotations

import random

import pytest
import torch

from parallel.dp.host_flat import HostFlat, chunk_layout


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _entries(sizes):
    out, off = [], 0
    for n in sizes:
        out.append((off, n))
        off += n
    return out


@pytest.mark.parametrize("seed", range(40))
def test_every_entry_in_one_chunk_and_every_chunk_but_the_last_a_power_of_two(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3000) for _ in range(rng.randint(1, 60))]
    entries, chunk_bytes = _entries(sizes), rng.choice([64, 1024, 8192])
    layout = chunk_layout(entries, 4, chunk_bytes)
    assert layout[0][0] == 0
    ends = [start for start, _ in layout[1:]] + [sum(sizes)]   # a chunk's elements end there
    for k, (start, cap) in enumerate(layout):
        inside = [(o, n) for o, n in entries if start <= o < ends[k]]
        assert inside and inside[0][0] == start
        assert all(o + n <= start + cap for o, n in inside)           # whole entries only
        used = sum(n for _, n in inside)
        if k + 1 < len(layout):
            nxt = next(n for o, n in entries if o == start + used)
            assert layout[k + 1][0] == start + used
            assert cap - used < nxt                                    # the next did not fit
            single = len(inside) == 1 and inside[0][1] * 4 > chunk_bytes
            assert single or (cap * 4 == _pow2_ceil(cap * 4) and cap * 4 <= chunk_bytes)
        else:
            assert cap == used                                         # the rest, exactly


def test_an_8b_offload_pins_little_more_than_its_state():
    """Llama-3-8B's shape at dp 1, fraction 0.85 (docs/benchmarks.md): 6.83e9 offloaded fp32
    elements in buckets of 10M elements. A pinned buffer per vector is rounded to 32 GiB; the
    chunks (each a power of two, the last rounded alone) pin at most 1% more than the state."""
    numel = int(0.85 * 8_030_261_248)
    sizes = [10_000_000] * (numel // 10_000_000) + [numel % 10_000_000]
    layout = chunk_layout(_entries(sizes), 4)
    pinned = sum(_pow2_ceil(cap * 4) for _, cap in layout)
    assert pinned <= 1.01 * 4 * numel
    assert _pow2_ceil(4 * numel) >= 1.25 * 4 * numel        # what one buffer would pin


def test_slices_are_views_of_the_chunks():
    flat = HostFlat(_entries([6, 6, 6, 3]), torch.float32, pin=False, chunk_bytes=64)
    assert [c.numel() for c in flat.chunks] == [16, 8, 3] and flat.numel() == 21
    flat[6:12] = torch.arange(6.0)
    flat[18:21] = torch.ones(3)
    assert torch.equal(flat.chunks[0][6:12], torch.arange(6.0))
    assert torch.equal(flat[18:21], torch.ones(3)) and flat[0:6].data_ptr() == flat.chunks[0].data_ptr()
    assert flat.allocated_bytes() == 4 * 27
    with pytest.raises(IndexError, match="not inside one chunk"):
        flat[10:14]
