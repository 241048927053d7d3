"""The expert grid's arithmetic (parallel/grid/expert_groups.py), without a process group."""
import pytest

from kernels.fp8_grouped import SegmentSlots
from parallel.grid.expert_groups import ExpertGrid
from parallel.grid.topology import RankGrid


def test_worked_example_tp2_dp4_ep2():
    eg = ExpertGrid(RankGrid(tp=2, dp=4), ep=2)
    assert eg.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert eg.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert eg.groups("etp") == [[r] for r in range(8)]
    assert eg.edp == 2 and eg.expert_rank(6) == 1 and eg.expert_rank(1) == 0
    assert eg.group_of(5, "ep") == [5, 7] and eg.group_of(5, "edp") == [1, 5]


def test_dp2_ep2_and_pipeline_stages():
    eg = ExpertGrid(RankGrid(dp=2), ep=2)
    assert eg.groups("ep") == [[0, 1]] and eg.groups("edp") == [[0], [1]]
    # pp=2: EP groups never leave their stage
    eg = ExpertGrid(RankGrid(pp=2, dp=4), ep=4)
    assert eg.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eg.groups("edp") == [[r] for r in range(8)]
    # with cp the EP ranks come from dp x cp (cp varies faster)
    eg = ExpertGrid(RankGrid(cp=2, dp=2), ep=2)
    assert eg.groups("ep") == [[0, 1], [2, 3]] and eg.groups("edp") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("grid,ep", [(RankGrid(tp=2, pp=2, dp=4), 2), (RankGrid(tp=2, dp=4), 4),
                                     (RankGrid(dp=8), 1), (RankGrid(cp=2, dp=3), 3)])
def test_partitions_and_products(grid, ep):
    eg = ExpertGrid(grid, ep)
    for dim in ("ep", "edp", "etp"):
        flat = sorted(r for g in eg.groups(dim) for r in g)
        assert flat == list(range(grid.world_size)), dim
    assert {len(g) for g in eg.groups("ep")} == {ep}
    assert {len(g) for g in eg.groups("edp")} == {grid.dp * grid.cp // ep}
    for ep_group in eg.groups("ep"):  # one tp and pp coordinate per EP group
        coords = {(grid.coord(r).tp, grid.coord(r).pp) for r in ep_group}
        assert len(coords) == 1


def test_local_experts_and_bad_input():
    assert ExpertGrid.local_experts(8, 2, 1) == range(4, 8)
    with pytest.raises(ValueError, match="--num-experts 6 is not divisible"):
        ExpertGrid.local_experts(6, 4, 0)
    with pytest.raises(ValueError, match="must divide dp x cp = 3 x 1 = 3"):
        ExpertGrid(RankGrid(dp=3), ep=2)
    with pytest.raises(ValueError, match="--expert-tensor-parallel-size 2: only 1"):
        ExpertGrid(RankGrid(dp=2), ep=1, etp=2)
    with pytest.raises(ValueError, match="positive integer"):
        ExpertGrid(RankGrid(dp=2), ep=0)
    with pytest.raises(ValueError, match="unknown dimension"):
        ExpertGrid(RankGrid(dp=2), ep=2).groups("dp")


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-dp-cp-pp", "dp-tp-cp-pp", "cp-pp-dp-tp"])
@pytest.mark.parametrize("sizes, ep", [(dict(dp=2, cp=2), 2), (dict(cp=4), 2),
                                       (dict(dp=3, cp=2), 3), (dict(tp=2, dp=2, cp=2), 4),
                                       (dict(pp=2, dp=2, cp=2), 1), (dict(dp=4, cp=2), 4)])
def test_ep_group_start_names_each_sources_micro_batch(sizes, ep, order):
    """FP8's SegmentSlots (kernels/fp8_grouped.py) maps EP source j to micro-batch
    (start + j) // stride % dp: the DP coordinate of the rank at that place of the EP group,
    whichever of DP and CP varies faster in the rank order (DP first was mapped as if CP were)."""
    grid = RankGrid(order=order, **sizes)
    eg = ExpertGrid(grid, ep=ep)
    for rank in range(grid.world_size):
        group = eg.group_of(rank, "ep")
        slots = SegmentSlots(eg.ep_group_start(rank), ep, eg.micro_stride(), grid.dp)
        assert slots.index(ep, "cpu").tolist() == [grid.coord(r).dp for r in group], (rank, group)
