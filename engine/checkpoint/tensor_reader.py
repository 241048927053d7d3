"""Reading any box of a logical tensor back from a checkpoint (engine/checkpoint/index.py's
format): only the stored pieces that overlap it are read, box pieces as safetensors slices, flat
pieces (a ZeRO-1 rank's range of its shard) by the rows they touch; what lies outside the logical
shape (vocabulary padding) reads as zero, and an element no piece covers is an error. This is how
a checkpoint loads under any layout: each rank reads the boxes its own parameters hold.
"""
from __future__ import annotations

import math
import os

import torch
from safetensors import safe_open

from engine.checkpoint.index import CheckpointError


def _intersect(a_off, a_shape, b_off, b_shape):
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


def _flat_index(idx, shape) -> int:
    out = 0
    for i, n in zip(idx, shape):
        out = out * n + i
    return out


class TensorReader:
    """Reads any box (or flat range of a box) of a logical tensor, touching only the stored slices
    that overlap it. Elements outside the logical shape (vocabulary padding) read as zero."""

    def __init__(self, ckpt: str, index: dict):
        self.ckpt, self.index, self._open = ckpt, index, {}

    def __contains__(self, name: str) -> bool:
        return name in self.index["tensors"]

    def _slice(self, name: str, piece: dict, ranges: list[tuple[int, int]]) -> torch.Tensor:
        fname, key = piece["file"], piece["key"]
        try:
            if fname not in self._open:
                self._open[fname] = safe_open(os.path.join(self.ckpt, fname), framework="pt")
            sl = self._open[fname].get_slice(key)
            return sl[tuple(slice(a, b) for a, b in ranges)]
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{os.path.join(self.ckpt, fname)}: cannot read tensor {key!r} "
                                  f"({name}): {exc}") from exc

    def read(self, name: str, offsets, shape, flat: tuple[int, int] | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``global[offsets : offsets + shape]`` of logical tensor ``name``, or elements
        [flat[0], flat[1]) of that box flattened (returned 1-D)."""
        entry = self.index["tensors"][name]
        gshape = entry["shape"]
        offsets, shape = list(offsets), list(shape)
        if flat is not None and shape:  # shrink the box to the rows the flat range touches
            row = math.prod(shape[1:])
            r0, r1 = flat[0] // row, -(-flat[1] // row) if flat[1] > flat[0] else flat[0] // row
            offsets[0] += r0
            shape[0] = r1 - r0
            flat = (flat[0] - r0 * row, flat[1] - r0 * row)
        out = torch.zeros(shape, dtype=dtype)
        covered = torch.ones(shape, dtype=torch.bool)  # padding outside the logical shape: zeros
        inside = _intersect(offsets, shape, [0] * len(gshape), gshape)
        if inside is not None:  # every element inside the logical shape must come from a piece
            lo, n = inside
            covered[tuple(slice(a - o, a - o + m) for a, o, m in zip(lo, offsets, n))] = False
        for piece in entry["pieces"]:
            hit = _intersect(offsets, shape, piece["offsets"], piece["shape"])
            if hit is None:
                continue
            lo, n = hit
            dst = tuple(slice(a - o, a - o + m) for a, o, m in zip(lo, offsets, n))
            if "flat" not in piece:
                src = [(a - p, a - p + m) for a, p, m in zip(lo, piece["offsets"], n)]
                out[dst] = self._slice(name, piece, src).to(dtype)
                covered[dst] = True
                continue
            self._read_flat(name, piece, lo, n, out[dst], covered[dst])
        if flat is not None:
            out, covered = out.reshape(-1)[flat[0]:flat[1]], covered.reshape(-1)[flat[0]:flat[1]]
        if not bool(covered.all()):
            raise CheckpointError(f"checkpoint {self.ckpt} does not cover {name} at offsets {offsets} "
                                  f"shape {shape}: the index lacks pieces (was the save complete?)")
        return out

    def _read_flat(self, name, piece, lo, n, out_view, covered_view) -> None:
        """Copy the part of a flat piece that falls into the box (lo, n) into out_view."""
        p_off, p_shape = piece["offsets"], piece["shape"]
        start, end = piece["flat"]
        local_lo = [a - p for a, p in zip(lo, p_off)]
        local_last = [a + m - 1 for a, m in zip(local_lo, n)]
        first = max(start, _flat_index(local_lo, p_shape))
        last = min(end, _flat_index(local_last, p_shape) + 1)
        if first >= last:
            return
        row = math.prod(p_shape[1:])
        r0, r1 = first // row, (last - 1) // row + 1
        data = self._slice(name, piece, [(first - start, last - start)]).reshape(-1)
        rows = torch.zeros((r1 - r0) * row, dtype=out_view.dtype)
        mask = torch.zeros((r1 - r0) * row, dtype=torch.bool)
        rows[first - r0 * row:last - r0 * row] = data.to(out_view.dtype)
        mask[first - r0 * row:last - r0 * row] = True
        rows, mask = rows.view(r1 - r0, *p_shape[1:]), mask.view(r1 - r0, *p_shape[1:])
        # rows cover piece rows [r0, r1); the box covers piece rows [local_lo[0], local_last[0]]
        a0, a1 = max(r0, local_lo[0]), min(r1, local_last[0] + 1)
        if a0 >= a1:
            return
        src = (slice(a0 - r0, a1 - r0),) + tuple(slice(l, l + m) for l, m in zip(local_lo[1:], n[1:]))
        dst = (slice(a0 - local_lo[0], a1 - local_lo[0]),)
        sel = mask[src]
        out_view[dst][sel] = rows[src][sel]
        covered_view[dst] |= sel
