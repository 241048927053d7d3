"""An MoE layer's figures summed over its forwards since the last reset (``MoELayer.totals``).

Device tensors, fp32, updated in place by each forward that is not a recomputation inside a
backward: the forwards counted, the balancing losses' shares (aux, z), the assignments a capacity
dropped, and the per-expert load (E,). In place, because a compiled chunk's graph must not depend
on how many forwards a step has run: a Python list grown inside the graph was a guard on its
length (Dynamo), so every micro-batch of a step needed a graph of its own and, past the chunk's
recompile limit, ran eagerly. Counts are exact in fp32 up to 2**24.
"""
from __future__ import annotations

import torch


class MoETotals:
    def __init__(self, num_experts: int, device):
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float32, device=device)
        self.forwards, self.aux_loss, self.z_loss, self.dropped = zeros(), zeros(), zeros(), zeros()
        self.load = zeros(num_experts)                                          # (E,)

    def add(self, aux, z, load: torch.Tensor, dropped) -> None:
        """One forward's figures (``aux``, ``z``, ``dropped``: 0-d tensors, or None for none)."""
        self.forwards.add_(1)
        for total, value in ((self.aux_loss, aux), (self.z_loss, z), (self.dropped, dropped)):
            if value is not None:
                total.add_(value.detach().float())
        self.load.add_(load.detach().float())

    def zero_(self) -> None:
        for t in (self.forwards, self.aux_loss, self.z_loss, self.dropped, self.load):
            t.zero_()

    @property
    def device(self) -> torch.device:
        return self.load.device
