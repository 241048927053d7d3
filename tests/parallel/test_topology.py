import pytest

from parallel.grid.launch import LaunchEnv, LayoutError, check_layout
from parallel.grid.topology import Coord, RankGrid
from tests.helpers.dist_utils import run_distributed


def test_design_example_16_ranks():
    g = RankGrid(tp=2, pp=2, dp=4)
    assert g.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("pp") == [[i, i + 8] for i in range(8)]
    assert g.coord(13) == Coord(tp=1, pp=1, dp=2)
    assert g.groups("mp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert g.groups("embedding") == g.groups("pp")


def test_other_orders_and_shapes():
    g = RankGrid(tp=2, pp=4, dp=1)
    assert g.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.groups("embedding") == [[0, 6], [1, 7]]
    g = RankGrid(tp=2, pp=2, dp=2, order="tp-pp-dp")
    assert g.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = RankGrid(tp=4, pp=1, dp=2, order="dp-tp-pp")
    assert g.groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("tp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert RankGrid(pp=1).groups("embedding") == [[0]]
    # every rank appears in exactly one group of each dimension
    for dim in ("tp", "pp", "dp", "mp"):
        flat = sorted(r for grp in RankGrid(2, 2, 2).groups(dim) for r in grp)
        assert flat == list(range(8))


def test_coord_roundtrip():
    g = RankGrid(tp=2, pp=3, dp=2)
    for r in range(g.world_size):
        assert g.rank_of(**g.coord(r)._asdict()) == r


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp=0), "tp must be a positive"),
    (dict(order="tp-pp"), "order must name"),
    (dict(cp=0), "cp must be a positive"),
    (dict(order="tp-cp-pp-pp"), "order must name"),
])
def test_grid_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankGrid(**kwargs)


def test_layout_errors():
    with pytest.raises(LayoutError, match="world size 8 != tp\\*pp\\*dp"):
        check_layout(RankGrid(tp=2, pp=2, dp=1), LaunchEnv(0, 8, 0, 8))
    with pytest.raises(LayoutError, match="span nodes"):
        check_layout(RankGrid(tp=4, pp=1, dp=2), LaunchEnv(0, 8, 0, 2))
    notes = check_layout(RankGrid(tp=1, pp=3, dp=2), LaunchEnv(0, 6, 0, 3))
    assert notes and "pipeline stages" in notes[0]
    assert check_layout(RankGrid(tp=2, pp=2, dp=2), LaunchEnv(0, 8, 0, 4)) == []


def test_launch_env_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "4(x2)"}
    assert LaunchEnv.from_env(env) == LaunchEnv(5, 8, 1, 4)


def test_context_parallel_grid():
    """The DESIGN example with cp: order tp-cp-dp-pp, CP groups inside TP-stride blocks."""
    g = RankGrid(tp=2, cp=2, pp=2, dp=2)
    assert g.world_size == 16
    assert g.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("pp") == [[i, i + 8] for i in range(8)]
    assert g.coord(13) == Coord(tp=1, pp=1, dp=1, cp=0)
    assert g.coord(6) == Coord(tp=0, pp=0, dp=1, cp=1)
    assert g.groups("mp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    # cp=1 keeps the three-dimension example, and the three-name order means the same grid
    assert RankGrid(tp=2, pp=2, dp=4).groups("dp") == RankGrid(tp=2, pp=2, dp=4, order="tp-dp-pp").groups("dp")
    assert RankGrid(tp=2, pp=2, dp=4).groups("dp_cp") == RankGrid(tp=2, pp=2, dp=4).groups("dp")
    # the short order spelling puts cp right after tp
    assert RankGrid(tp=2, cp=2, dp=2, order="tp-dp-pp").groups("cp") == g.groups("cp")[:4]
    g2 = RankGrid(tp=1, cp=4, pp=1, dp=2, order="cp-tp-dp-pp")
    assert g2.groups("cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for grid in (g, g2, RankGrid(tp=2, cp=2, pp=3, dp=1)):
        for dim in ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding"):
            groups = grid.groups(dim)
            for r in range(grid.world_size):
                if dim == "embedding" and grid.coord(r).pp not in (0, grid.pp - 1):
                    with pytest.raises(ValueError, match="middle pipeline stage"):
                        grid.group_of(r, dim)
                    continue
                assert grid.group_of(r, dim) in groups
                assert r in grid.group_of(r, dim)
            if dim != "embedding":
                assert sorted(r for grp in groups for r in grp) == list(range(grid.world_size))
        for r in range(grid.world_size):
            assert grid.rank_of(**grid.coord(r)._asdict()) == r


def _groups_check(ps):
    import torch
    out = {}
    for dim in ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding"):
        t = torch.tensor([float(ps.rank)])
        group = getattr(ps, f"{dim}_group")
        group.all_reduce(t)
        out[dim] = (t.item(), list(group.ranks), group.rank)
    return out


def test_process_groups_on_gloo():
    for grid in (RankGrid(tp=2, pp=2, dp=2), RankGrid(tp=2, cp=2, dp=2)):
        results = run_distributed(_groups_check, grid=grid)
        for rank, res in enumerate(results):
            for dim in ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding"):
                want = grid.group_of(rank, dim)
                assert res[dim] == (sum(want), want, want.index(rank)), (rank, dim)
