"""Layout-independent sampling: the global batch of step k is a function of (seed, k) alone.

Samples are drawn from an endless stream of epochs; epoch e is a permutation of all sample indices
generated from (seed, e). Step k takes stream positions [k*G, (k+1)*G) for global batch size G, so a
global batch may straddle an epoch boundary. Every layout then cuts the same global batch: DP rank r
takes the r-th consecutive slice, and its micro-batches are consecutive slices of that. This is what
lets any (tp, pp, dp, micro-batch) layout train on exactly the samples of the serial run.

``BlendedSampler`` does the same for a blend of datasets (``--data-path 0.3 A 0.7 B``): step k
takes n_m(k) samples from member m, floor(G w_m) plus a share of the remainder placed by a
low-discrepancy (Weyl) sequence seeded by the run's seed, so over any span of steps every member
gets its weight's share to within one sample per step. Member m's samples come from its own
endless stream of seeded epochs, from position C_m(k) (the samples it gave to steps 0..k-1, a sum
over steps that is memoised for the sequential access of training); the global batch is then
shuffled by (seed, k). All of it depends on (seed, k) alone.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

MEMO_EPOCHS = 2  # epoch permutations a sampler keeps (each is num_samples int32 or int64)


def epoch_order(num_samples: int, seed: int, key: tuple, epoch: int) -> np.ndarray:
    """All sample indices of one epoch in its seeded order: (num_samples,), drawn from the
    generator seeded by (seed, *key, epoch) and nothing else; kept as int32 where the indices fit
    (below 2^31 samples: half the memory of numpy's int64 draw, 2 GB less per rank and epoch held
    at 500 M samples), the same values."""
    order = np.random.default_rng([seed, *key, epoch]).permutation(num_samples)
    return order.astype(np.int32) if num_samples <= np.iinfo(np.int32).max else order


class GlobalBatchSampler:
    """Seeded global batches with a resumable position (``next_step``) for checkpoints."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, key: tuple = ()):
        """``key``: integers drawn into every epoch's seed after ``seed`` (a blend's member stream)."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}: the dataset is empty")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed, self.key = seed, tuple(key)
        self.next_step = 0  # the step whose batch the training loop consumes next
        # the last MEMO_EPOCHS epochs' permutations used, least recently used first
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """The order of all samples in ``epoch``: (num_samples,), seeded by (seed, *key, epoch)
        (``epoch_order``: int32 where the indices fit).
        Memoised for the MEMO_EPOCHS epochs used last, so a batch straddling two epochs, read
        twice in a step (the loss count and the micro-batches), builds each permutation once."""
        if epoch in self._perms:
            self._perms.move_to_end(epoch)
            return self._perms[epoch]
        if len(self._perms) >= MEMO_EPOCHS:  # keep memory flat: drop the least recently used
            self._perms.popitem(last=False)
        self._perms[epoch] = epoch_order(self.num_samples, self.seed, self.key, epoch)
        return self._perms[epoch]

    def take(self, pos: int, end: int) -> list[int]:
        """Stream positions [pos, end) as sample indices."""
        n, out = self.num_samples, []
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            out += self.epoch_permutation(epoch)[offset: offset + take].tolist()
            pos += take
        return out

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of the global batch of 0-based ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.take(step * self.global_batch_size, (step + 1) * self.global_batch_size)

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
        """Restore the position. A different dataset or global batch size would silently change
        which samples follow, and a different seed too: the order would be the checkpoint's while
        the run's --seed draws the train/validation split of the documents and the validation
        batches (engine/training/run_data.py), so a resumed run could train on another split,
        former validation documents among them. All three are refused."""
        mine = self.state_dict()
        if int(state["seed"]) != self.seed:
            raise ValueError(f"its data order was drawn with --seed {state['seed']} and this run has "
                             f"--seed {self.seed}, which also draws the train/validation split: "
                             f"resume with --seed {state['seed']}, or start a new data order from "
                             f"its weights with --finetune")
        for key in ("num_samples", "global_batch_size", "blend"):
            if key in state and state[key] != mine.get(key):
                raise ValueError(f"the checkpoint's sampler has {key}={state[key]} but this run has "
                                 f"{mine.get(key)}: resume with the same data and --global-batch-size")
        self.next_step = int(state["next_step"])
        self._reseed()

    def _reseed(self) -> None:
        self._perms.clear()


_BLEND, _MIX = 0xB1E, 0x313  # stream tags next to the run's seed
_GOLDEN = (5 ** 0.5 - 1) / 2
_CHUNK = 1 << 16


class BlendedSampler(GlobalBatchSampler):
    """Global batches over a ``BlendedDataset`` (members side by side in one index space)."""

    def __init__(self, sizes: list[int], weights: list[float], global_batch_size: int, seed: int):
        if not sizes or len(sizes) != len(weights) or min(sizes) < 1 or min(weights) <= 0:
            raise ValueError("a blend needs at least one non-empty member with a positive weight")
        super().__init__(int(sum(sizes)), global_batch_size, seed)
        self.sizes, self.weights = list(sizes), [w / sum(weights) for w in weights]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        g = np.asarray(self.weights) * global_batch_size
        self._base = np.floor(g).astype(np.int64)                                  # (M,)
        frac = g - self._base
        self._bounds = np.concatenate([[0.0], np.cumsum(frac)])                     # (M+1,)
        self._bounds[-1] = float(global_batch_size - self._base.sum())              # = R exactly
        self._reseed()

    def _reseed(self) -> None:
        self._perms.clear()
        if not hasattr(self, "sizes"):
            return
        self._phase = float(np.random.default_rng([_BLEND, self.seed]).random())
        # member m's own epochs: rng([seed, BLEND, m, epoch])
        self._members = [GlobalBatchSampler(n, self.global_batch_size, self.seed, key=(_BLEND, m))
                         for m, n in enumerate(self.sizes)]
        self._memo = (0, np.zeros(len(self.sizes), dtype=np.int64))

    def step_counts(self, steps: np.ndarray) -> np.ndarray:
        """Samples each member gives to each of ``steps``: (K, M) int64, rows summing to G."""
        u = np.mod(np.asarray(steps, dtype=np.float64) * _GOLDEN + self._phase, 1.0)[:, None]  # (K, 1)
        extra = np.ceil(self._bounds[1:] - u) - np.ceil(self._bounds[:-1] - u)               # (K, M)
        return self._base[None, :] + extra.astype(np.int64)

    def consumed(self, step: int) -> np.ndarray:
        """Samples each member gave to steps 0..step-1: (M,) int64."""
        done, total = self._memo
        if step < done:
            done, total = 0, np.zeros(len(self.sizes), dtype=np.int64)
        while done < step:
            upto = min(step, done + _CHUNK)
            total = total + self.step_counts(np.arange(done, upto)).sum(axis=0)
            done = upto
        self._memo = (done, total)
        return total

    def global_batch(self, step: int) -> list[int]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = self.consumed(step)
        counts = self.step_counts(np.array([step]))[0]
        out: list[int] = []
        for m, (c, n) in enumerate(zip(start.tolist(), counts.tolist())):
            out += [int(self.offsets[m]) + i for i in self._members[m].take(c, c + n)]
        order = np.random.default_rng([self.seed, _MIX, step]).permutation(len(out))
        return [out[i] for i in order]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "blend": [[n, w] for n, w in zip(self.sizes, self.weights)]}
