"""The vocab-parallel output layer of a last model chunk: logits over this rank's vocabulary rows.

It is a module with a forward of its own, so the parameter it owns is read inside its own call:
ZeRO's overlapped parameter gather waits for a unit's buckets in the unit's forward pre-hook
(parallel/dp/param_gather.py), and the output weight, gathered last, is then waited for only
when the logits are computed, not at the chunk's start.

With tied embeddings it owns no parameter and reads the word embedding of a module that ran
before it (this chunk's, or under the V placement the first chunk's on the same rank): that
weight was waited for when the embedding ran; under ZeRO-3 it names that weight in
``foreign_parameters()``, which keeps it gathered. Under a zero-bubble schedule its weight gradient
is deferred to W like the parallel linears' (``weight_grad_store``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.tensor_parallel.split_linear import linear_defer_w


class OutputLayer(nn.Module):
    def __init__(self, weight: nn.Parameter | None = None, tied: nn.Module | None = None):
        """``weight``: the (V_pad/tp, h) parameter it owns; else ``tied``: the embedding module
        whose ``weight`` it reads (not registered here: one parameter, one owner)."""
        super().__init__()
        if (weight is None) == (tied is None):
            raise ValueError("OutputLayer: give either its own weight or the tied embedding")
        if weight is not None:
            self.weight = weight
        else:
            object.__setattr__(self, "_tied", tied)  # not a submodule
        self.weight_grad_store = None  # a zero-bubble schedule's W takes the weight gradient

    @property
    def owns_weight(self) -> bool:
        return "_tied" not in self.__dict__

    def foreign_parameters(self) -> list[nn.Parameter]:
        """The parameter of another module it reads (the tied embedding's weight): ZeRO-3 keeps
        it gathered from the embedding's forward to this layer's backward
        (parallel/dp/zero3_units.py)."""
        return [] if self.owns_weight else [self.__dict__["_tied"].weight]

    def matrix(self) -> torch.Tensor:
        return self.weight if self.owns_weight else self.__dict__["_tied"].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, V_pad/tp)
        if self.weight_grad_store is None:
            return F.linear(x, self.matrix())
        return linear_defer_w(x, self.matrix(), None, self.weight_grad_store)
