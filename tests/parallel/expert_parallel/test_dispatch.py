"""The alltoall token dispatcher on two gloo ranks (one EP group): rows land on the rank holding
their expert, sorted by (local expert, source rank), with each local expert's row offset on the
device; combine inverts it; gradients travel back, each to its own token (a random upstream
gradient); the collectives are the counts' all-to-all and one all-to-all with split sizes each
way, on the "ep" group; the forward reads the host once (the split sizes, counted by the step's
wait counter in strict mode), the backward not at all. The (local expert, source rank) row
segments (FP8's weight-gradient scales, kernels/fp8_grouped.py) are the same for the alltoall and
the allgather dispatcher."""
from __future__ import annotations

import torch

from engine.device.syncs import SyncCounter
from parallel.expert_parallel import (allgather_dispatch, alltoall_combine, alltoall_dispatch,
                                      init_expert_groups, permute_tokens, unpermute_tokens)
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import record_comm, run_distributed

E, K, T, H = 4, 2, 5, 3


def _tokens(rank: int):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # (T, K)
    return x, experts


def _dispatch(ps):
    init_expert_groups(ps, 2)
    group = ps.ep_group
    x, experts = _tokens(ps.rank)
    x.requires_grad_(True)
    weights = torch.full((T, K), 0.5)
    # a random upstream gradient: each token's gradient must come back to that token's row
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + ps.rank))
    counter = SyncCounter(strict=True)
    with record_comm(ps) as events:
        with counter.step(), counter.watching():  # the dispatcher's own waits, forward and back
            rows, perm = permute_tokens(x, experts, E)
            got, state = alltoall_dispatch(rows, perm.counts, group)
            back = alltoall_combine(got * 2.0, state, group)
            out = unpermute_tokens(back, weights, perm)  # each token: 2 copies x 0.5 x 2x
            out.backward(g)
    # the split sizes' one read, in the forward; nothing else, the backward included
    assert [e.name for e in counter.last] == ["tensor.tolist"]
    # the expected rows: every rank's copies for my experts, by (local expert, source rank)
    want = []
    for local in range(E // 2):
        e = 2 * ps.rank + local
        for src in range(2):
            sx, se = _tokens(src)
            want += [sx[t] for t in range(T) for j in range(K) if se[t, j] == e]
    assert torch.equal(got, torch.stack(want))
    per_expert = [sum(int((_tokens(s)[1] == 2 * ps.rank + i).sum()) for s in range(2))
                  for i in range(2)]
    assert state.offsets.tolist() == [per_expert[0], per_expert[0] + per_expert[1]]
    per_source = [int((_tokens(s)[1] == 2 * ps.rank + i).sum()) for i in range(2) for s in range(2)]
    segments = torch.cumsum(torch.tensor(per_source), 0).tolist()
    assert state.segments.tolist() == segments
    _, zero_width = permute_tokens(x.detach()[:, :0], experts, E)
    _, gathered = allgather_dispatch(x.detach(), weights, zero_width, group)
    assert gathered.segments.tolist() == segments
    torch.testing.assert_close(out, 2.0 * x)
    torch.testing.assert_close(x.grad, 2.0 * g, rtol=0, atol=0)   # out = 2x: dx = 2g
    ops = [(e.op, e.group) for e in events]
    # forward: the counts, the rows, the rows back; backward: one all-to-all per direction
    assert ops == [("all_to_all", "ep")] * 5, ops
    return True


def test_alltoall_dispatch_two_ranks():
    assert run_distributed(_dispatch, grid=RankGrid(dp=2)) == [True, True]
