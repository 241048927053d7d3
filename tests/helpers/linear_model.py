"""A linear model whose gradients are known in advance, and the full optimizer state of its one
parameter under no ZeRO (MixedPrecisionOptimizer) or ZeRO (DistributedOptimizer, gathered over DP),
for the compression tests (tests/parallel/dp/)."""
from __future__ import annotations

import torch
from torch import nn

from tests.helpers.dist_utils import gather_tensors


class Linear(nn.Module):
    """loss = <w, c>: the gradient is c, whatever w."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, c):
        return (self.w * c).sum()


def full_state(ps, opt, stage: int, key: str, n: int) -> torch.Tensor:
    """The optimizer's ``key`` (exp_avg, exp_avg_sq) of the whole parameter, on every rank."""
    if not stage:
        st = opt.inner.state.get(opt.masters[0], {})
        return st[key].clone() if key in st else torch.zeros(n)
    t = getattr(opt, key)
    return torch.cat(gather_tensors(ps.dp_group, t.clone()))[:n]
