"""Peak activation memory of a pipeline step, measured from the tensors actually kept alive.

    tracker = ActivationMemory()
    with tracker.watch(trainer):          # autograd's saved tensors + what W closures keep
        trainer.train_one(step)
    tracker.peak_bytes                    # the most bytes held at once, sampled after every action

Counted: every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``:
packed when saved, released when the graph frees it) and every tensor a zero-bubble W closure keeps
until it runs (``WeightGradStore.on_hold``). A storage held by several of them counts once;
parameters are not activations and are left out. The total is sampled after each executor action
(its timeline stamp), so the peak is the largest amount held between two actions of the rank: for
1F1B the activations of the micro-batches in flight, for a zero-bubble schedule also what B leaves
for W (the layers' inputs and output gradients) until W has run.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from engine.dryrun.record import _Held, _storage


def _key(t: torch.Tensor) -> tuple[int, int]:
    return _storage(t), t.untyped_storage().nbytes()


class ActivationMemory:
    def __init__(self) -> None:
        self.live: dict[tuple[int, int], int] = {}   # storage -> holders
        self.current = self.peak_bytes = 0

    def _add(self, t: torch.Tensor) -> tuple[int, int] | None:
        if isinstance(t, torch.nn.Parameter) or t.numel() == 0:
            return None
        key = _key(t)
        if self.live.get(key, 0) == 0:
            self.current += key[1]
        self.live[key] = self.live.get(key, 0) + 1
        return key

    def _drop(self, keys) -> None:
        for key in keys:
            if key is None or key not in self.live:
                continue
            self.live[key] -= 1
            if self.live[key] == 0:
                del self.live[key]
                self.current -= key[1]

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current)

    # ---- hooks ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        holder = _Held(t)
        weakref.finalize(holder, self._drop, [self._add(t)])
        return holder

    @staticmethod
    def _unpack(holder):
        return holder.tensor

    def _on_hold(self, tensors, token) -> None:
        weakref.finalize(token, self._drop, [self._add(t) for t in tensors])

    @contextmanager
    def watch(self, trainer):
        """Count ``trainer``'s step: its executor's actions are the sampling points."""
        from parallel.pipeline import executor
        record = executor._RankRun.record
        tracker = self

        def sampled(run, *args, **kwargs):
            tracker.sample()
            return record(run, *args, **kwargs)

        store = getattr(trainer, "weight_grads", None)
        executor._RankRun.record = sampled
        if store is not None:
            store.on_hold = self._on_hold
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            executor._RankRun.record = record
            if store is not None:
                store.on_hold = None
