"""Blending several datasets: Megatron's ``--data-path 0.3 PREFIX_A 0.7 PREFIX_B``.

``parse_data_path`` reads the three spellings Megatron accepts: one prefix; weight-prefix pairs;
several prefixes without weights (then weighted by their number of training samples). Weights are
normalised. ``BlendedDataset`` puts the member datasets side by side in one index space (member m
holds indices [offset_m, offset_m + len_m)); which indices a step draws is the ``BlendedSampler``'s
job (sampler.py), a function of (seed, step) alone, like every other sampler here.
"""
from __future__ import annotations

import numpy as np


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(items: list[str] | str | None) -> list[tuple[float | None, str]] | None:
    """``["0.3", "A", "0.7", "B"]`` -> [(0.3, "A"), (0.7, "B")] (not yet normalised);
    ``["A"]`` -> [(None, "A")]; ``["A", "B"]`` -> [(None, "A"), (None, "B")]."""
    if items is None:
        return None
    if isinstance(items, str):
        items = items.split()
    items = [str(i) for i in items]
    if not items:
        raise ValueError("--data-path needs a prefix, or weight prefix pairs such as 0.3 A 0.7 B")
    weights = [_weight(i) for i in items]
    if weights[0] is None:  # prefixes only
        if any(w is not None for w in weights):
            raise ValueError(f"--data-path {' '.join(items)}: mixes weighted and unweighted entries; "
                             f"give weight prefix pairs (0.3 A 0.7 B) or prefixes only")
        return [(None, p) for p in items]
    if len(items) % 2 or any(w is None for w in weights[::2]) or any(w is not None for w in weights[1::2]):
        raise ValueError(f"--data-path {' '.join(items)}: weights and prefixes must alternate, "
                         f"e.g. --data-path 0.3 PREFIX_A 0.7 PREFIX_B")
    pairs = [(weights[i], items[i + 1]) for i in range(0, len(items), 2)]
    if any(w < 0 for w, _ in pairs) or sum(w for w, _ in pairs) <= 0:
        raise ValueError(f"--data-path {' '.join(items)}: weights must be >= 0 with a positive sum")
    return pairs


def normalise(weights: list[float]) -> list[float]:
    total = float(sum(weights))
    return [w / total for w in weights]


class BlendedDataset:
    """Member datasets in one index space; ``ds[i]`` reads member m's sample i - offset_m."""

    def __init__(self, datasets: list, weights: list[float], names: list[str]):
        keep = [(d, w, n) for d, w, n in zip(datasets, weights, names) if len(d) > 0 and w > 0]
        self.datasets = [d for d, _, _ in keep]
        self.weights = normalise([w for _, w, _ in keep]) if keep else []
        self.names = [n for _, _, n in keep]
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])  # (M+1,)
        first = datasets[0]
        self.vocab_size, self.eot_id = first.vocab_size, first.eot_id
        self.tokenizer_spec = first.tokenizer_spec
        self.seq_length = first.seq_length

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        m = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.datasets[m][i - int(self.offsets[m])]

    def loss_tokens(self, indices, eod_id: int) -> int:
        """Unmasked input tokens over the samples ``indices``: each member's table (built lazily by
        the member, ``TokenDataset.loss_token_table``) looked up at i - offset_m; no sample read."""
        idx = np.asarray(indices, dtype=np.int64)                                # (n,)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample {int(idx.max() if idx.max() >= len(self) else idx.min())} "
                             f"out of range for {len(self)} samples")
        member = np.searchsorted(self.offsets, idx, side="right") - 1            # (n,)
        return sum(d.loss_tokens(idx[member == m] - self.offsets[m], eod_id)
                   for m, d in enumerate(self.datasets))
