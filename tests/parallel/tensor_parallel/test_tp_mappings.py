"""parallel/tensor_parallel/mappings.py: every communication function, forward and backward, on real
gloo groups of 2 and 4 ranks, against the same computation written serially.

One spawned group of 4 ranks serves both sizes: the TP=4 group comes from the grid, and two TP=2
groups ([0, 1], [2, 3]) are cut from the same world (``tp_states``). Each rank builds the full
tensors from a shared seed, so the expected result of every collective is computed locally.
Inputs are float32 (HCCL reduces no float64), compared to 1e-6: only the summation order differs.
"""
from __future__ import annotations



import pytest
import torch
import torch.distributed as dist

from parallel.runtime.comm import CommGroup
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import mappings
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

TIGHT = dict(rtol=1e-6, atol=1e-6)  # fp32: HCCL reduces no float64


def tp_states(ps: ParallelState) -> dict[int, ParallelState]:
    """ParallelStates for tp=2 and tp=4 inside a 4-rank world whose grid is tp=4.

    The tp=2 state uses groups [0, 1] and [2, 3], the ones RankGrid(tp=2, dp=2) defines, so its
    coordinates (tp_rank) agree with the grid. Groups are created on every rank in the same order.
    """
    assert ps.world_size == 4 and ps.tp_size == 4
    grid2 = RankGrid(tp=2, dp=2)
    mine = None
    for ranks in grid2.groups("tp"):
        group = dist.new_group(ranks, backend="gloo")
        if ps.rank in ranks:
            mine = CommGroup("tp", tuple(ranks), ranks.index(ps.rank), group, ps.comm)
    sub = ParallelState(grid2, rank=ps.rank, comm=ps.comm, tp_group=mine)
    return {2: sub, 4: ps}


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _fwd_bwd(fn, x: torch.Tensor, grad_out: torch.Tensor, group):
    x = x.clone().requires_grad_(True)
    y = fn(x, group)
    y.backward(grad_out)
    return y.detach(), x.grad


def _check_group(ps: ParallelState) -> None:
    group, n, r = ps.tp_group, ps.tp_size, ps.tp_rank
    b, s, h = 2, 4 * 3, 4 * 5
    x_all = _full(1, n, b, s, h)  # one (b, s, h) tensor per rank
    g_all = _full(2, n, b, s, h)
    x, g = x_all[0], g_all[0]  # replicated tensors: the same on every rank

    # copy_to_tp: forward identity; backward sums the ranks' gradients
    y, gx = _fwd_bwd(mappings.copy_to_tp, x, g_all[r], group)
    torch.testing.assert_close(y, x, **TIGHT)
    torch.testing.assert_close(gx, g_all.sum(0), **TIGHT)

    # reduce_from_tp: forward sums partial results; backward passes the replicated grad through
    y, gx = _fwd_bwd(mappings.reduce_from_tp, x_all[r], g, group)
    torch.testing.assert_close(y, x_all.sum(0), **TIGHT)
    torch.testing.assert_close(gx, g, **TIGHT)

    # scatter_to_tp: forward keeps this rank's last-dim slice; backward gathers the slices
    g_parts = g.chunk(n, dim=-1)
    y, gx = _fwd_bwd(mappings.scatter_to_tp, x, g_parts[r], group)
    torch.testing.assert_close(y, x.chunk(n, dim=-1)[r], **TIGHT)
    torch.testing.assert_close(gx, g, **TIGHT)

    # gather_from_tp: forward concatenates the last-dim slices; backward keeps this rank's slice
    y, gx = _fwd_bwd(mappings.gather_from_tp, x.chunk(n, dim=-1)[r], g, group)
    torch.testing.assert_close(y, x, **TIGHT)
    torch.testing.assert_close(gx, g.chunk(n, dim=-1)[r], **TIGHT)

    # gather_from_sequence: forward concatenates sequence shards; backward reduce-scatters
    # the ranks' (different) full-sequence gradients
    y, gx = _fwd_bwd(mappings.gather_from_sequence, x.chunk(n, dim=1)[r], g_all[r], group)
    torch.testing.assert_close(y, x, **TIGHT)
    torch.testing.assert_close(gx, g_all.sum(0).chunk(n, dim=1)[r], **TIGHT)

    # reduce_scatter_to_sequence: forward sums partials and keeps this rank's sequence shard;
    # backward gathers the shards' gradients
    y, gx = _fwd_bwd(mappings.reduce_scatter_to_sequence, x_all[r], g.chunk(n, dim=1)[r], group)
    torch.testing.assert_close(y, x_all.sum(0).chunk(n, dim=1)[r], **TIGHT)
    torch.testing.assert_close(gx, g, **TIGHT)

    # scatter_to_sequence: forward keeps this rank's sequence shard of a replicated tensor;
    # backward gathers
    y, gx = _fwd_bwd(mappings.scatter_to_sequence, x, g.chunk(n, dim=1)[r], group)
    torch.testing.assert_close(y, x.chunk(n, dim=1)[r], **TIGHT)
    torch.testing.assert_close(gx, g, **TIGHT)

    # non-contiguous inputs (a transposed view) give the same results
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous()
    y, _ = _fwd_bwd(mappings.reduce_scatter_to_sequence, xt * (r + 1), g.chunk(n, dim=1)[r], group)
    torch.testing.assert_close(y, (x * sum(range(1, n + 1))).chunk(n, dim=1)[r], **TIGHT)

    # the gradient flows back in the input's dtype, also for float32
    y, gx = _fwd_bwd(mappings.gather_from_sequence, x.float().chunk(n, dim=1)[r], g_all[r].float(),
                     group)
    assert y.dtype == gx.dtype == torch.float32

    # no function modifies its input or the incoming gradient (autograd may share them)
    torch.testing.assert_close(x_all, _full(1, n, b, s, h), rtol=0, atol=0)
    torch.testing.assert_close(g_all, _full(2, n, b, s, h), rtol=0, atol=0)
    one = x_all[r, :1].clone()  # batch 1: the sequence chunks are contiguous views
    for name in ("reduce_scatter_to_sequence", "gather_from_sequence", "copy_to_tp",
                 "reduce_from_tp"):
        fn = getattr(mappings, name)
        inp = one.chunk(n, dim=1)[r] if name == "gather_from_sequence" else one
        inp_copy = inp.clone()
        y = fn(inp.requires_grad_(True), group)
        go = torch.ones_like(y)
        y.backward(go)
        torch.testing.assert_close(inp.detach(), inp_copy, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(go, torch.ones_like(y), rtol=0, atol=0, msg=name)

    # a sequence that does not split over the group fails before any collective, saying why
    odd = _full(3, b, n * 3 + 1, h)
    for fn in (mappings.scatter_to_sequence, mappings.reduce_scatter_to_sequence):
        with pytest.raises(ValueError, match=rf"sequence length {n * 3 + 1}.*tp={n}"):
            fn(odd, group)
    with pytest.raises(ValueError, match=rf"{h + 1}.*{n}"):
        mappings.scatter_to_tp(_full(4, b, s, h + 1), group)


def check_mappings(ps: ParallelState) -> str:
    for sub in tp_states(ps).values():
        _check_group(sub)
    return "ok"


def test_mappings_tp2_and_tp4():
    assert run_distributed(check_mappings, grid=RankGrid(tp=4)) == ["ok"] * 4


def test_size_one_group_is_identity():
    x = torch.randn(2, 3, 4, requires_grad=True)
    for name in ("copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
                 "gather_from_sequence", "reduce_scatter_to_sequence", "scatter_to_sequence"):
        assert getattr(mappings, name)(x, None) is x, name
