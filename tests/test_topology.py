import pytest

from parallel.state import LaunchEnv, LayoutError, check_layout
from parallel.topology import Coord, RankGrid
from tests.dist_utils import run_distributed


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


def _groups_check(ps):
    import torch
    import torch.distributed as dist
    out = {}
    for dim in ("tp", "pp", "dp", "mp", "embedding"):
        t = torch.tensor([float(ps.rank)])
        dist.all_reduce(t, group=getattr(ps, f"{dim}_group"))
        out[dim] = t.item()
    return out


def test_process_groups_on_gloo():
    grid = RankGrid(tp=2, pp=2, dp=2)
    results = run_distributed(_groups_check, grid=grid)
    for rank, res in enumerate(results):
        for dim in ("tp", "pp", "dp", "mp", "embedding"):
            assert res[dim] == sum(grid.group_of(rank, dim)), (rank, dim)
