"""Train / validation / test splits by documents (``--split 969,30,1``).

The weights are normalised; the split sizes follow Megatron-LM's rounding (each boundary is
round(cumulative weight x documents), the rounding error taken from the first split). Which
documents go where is a seeded shuffle of the document ids, so a split never cuts a document and
validation text is never trained on. Worked example: 10 documents, ``--split 8,1,1`` gives 8, 1 and
1 documents; ``--split 969,30,1`` on 10 documents gives 10, 0 and 0 (no validation split).
"""
from __future__ import annotations

import re

import numpy as np

SPLITS = ("train", "valid", "test")
_SPLIT_STREAM = 0x5350  # the document shuffle's stream next to the run's seed


def parse_split(spec: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"98/2/0"``, or fewer parts, padded with 0) -> normalised weights."""
    parts = [p.strip() for p in re.split(r"[,/]", str(spec)) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {spec!r}: give up to three non-negative weights for train, "
                         f"validation and test, e.g. --split 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def split_sizes(num_docs: int, weights: tuple[float, float, float]) -> list[int]:
    """Documents per split, Megatron's way: boundaries rounded, the excess taken from train."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_docs)))
    excess = bounds[-1] - num_docs
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [max(0, b - a) for a, b in zip(bounds[:-1], bounds[1:])]


def document_split(num_docs: int, weights: tuple[float, float, float], seed: int) -> dict[str, np.ndarray]:
    """The document ids of each split: sorted (D_split,) int64 arrays, from a shuffle seeded by
    ``seed``. Sorted ids keep reads sequential in the token file; the sampler shuffles samples."""
    order = np.random.default_rng([_SPLIT_STREAM, seed]).permutation(num_docs)
    out, start = {}, 0
    for name, size in zip(SPLITS, split_sizes(num_docs, weights)):
        out[name] = np.sort(order[start:start + size]).astype(np.int64)
        start += size
    return out
