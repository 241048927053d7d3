"""Layout-independent sampling: the global batch of step k is a function of (seed, k) alone.

Samples are drawn from an endless stream of epochs; epoch e is a permutation of all sample indices
generated from (seed, e). Step k takes stream positions [k*G, (k+1)*G) for global batch size G, so a
global batch may straddle an epoch boundary. Every layout then cuts the same global batch: DP rank r
takes the r-th consecutive slice, and its micro-batches are consecutive slices of that. This is what
lets any (tp, pp, dp, micro-batch) layout train on exactly the samples of the serial run.
"""
from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    """Seeded global batches with a resumable position (``next_step``) for checkpoints."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}: the dataset is empty")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.next_step = 0  # the step whose batch the training loop consumes next
        self._perms: dict[int, np.ndarray] = {}  # memo of recent epochs' permutations

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The order of all samples in ``epoch``: (num_samples,) int64, seeded by (seed, epoch)."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most a few epochs; keep memory flat
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of the global batch of 0-based ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n, out = self.num_samples, []
        pos, end = step * self.global_batch_size, (step + 1) * self.global_batch_size
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            out += self.epoch_permutation(epoch)[offset: offset + take].tolist()
            pos += take
        return out

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[list[int]]:
        """This DP rank's consecutive slice of the global batch, cut into consecutive micro-batches."""
        per_step = micro_batch_size * dp_size
        if micro_batch_size < 1 or dp_size < 1 or self.global_batch_size % per_step:
            raise ValueError(f"global batch size {self.global_batch_size} is not divisible by micro batch "
                             f"size {micro_batch_size} x data-parallel size {dp_size} = {per_step}: "
                             f"choose --global-batch-size as a multiple of {per_step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        per_rank = self.global_batch_size // dp_size
        mine = self.global_batch(step)[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        return [mine[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "seed": self.seed, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position and seed. A different dataset or global batch size would silently change
        which samples follow, so those are refused."""
        for key in ("num_samples", "global_batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint's sampler has {key}={state[key]} but this run has "
                                 f"{getattr(self, key)}: resume with the same data and --global-batch-size")
        self.seed = int(state["seed"])
        self.next_step = int(state["next_step"])
        self._perms.clear()
