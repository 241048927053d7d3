"""Where a process sits under Slurm (``LaunchEnv.from_env``): the processes on its node come from
SLURM_TASKS_PER_NODE, which srun sets for every step, not only from --ntasks-per-node."""
import pytest

from parallel.grid.launch import LaunchEnv, LayoutError, check_layout, slurm_tasks_per_node
from parallel.grid.topology import RankGrid


def slurm(procid, ntasks, localid, **more):
    env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(localid)}
    return LaunchEnv.from_env(env | {f"SLURM_{k.upper()}": str(v) for k, v in more.items()})


def test_srun_without_ntasks_per_node_finds_its_nodes():
    """srun -N2 -n16: two nodes of 8, not one node of 16."""
    launch = slurm(9, 16, 1, tasks_per_node="8(x2)", nnodes=2, nodeid=1)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (9, 16, 1, 8)
    assert launch.num_nodes == 2 and launch.one_host([0, 7]) and not launch.one_host([7, 8])
    with pytest.raises(LayoutError, match="TP group of 16 ranks would span nodes of 8 processes"):
        check_layout(RankGrid(tp=16), launch)
    # without SLURM_TASKS_PER_NODE: the tasks over the nodes
    assert slurm(9, 16, 1, nnodes=2, nodeid=1).local_world_size == 8
    # --ntasks-per-node alone, as before; a stale SLURM_TASKS_PER_NODE (the job's, not this
    # step's: its counts do not add up to SLURM_NTASKS) is not read
    assert slurm(5, 8, 1, ntasks_per_node="4(x2)") == LaunchEnv(5, 8, 1, 4)
    assert slurm(5, 8, 1, ntasks_per_node=4, tasks_per_node="8(x2)", nodeid=1).local_world_size == 4
    assert slurm(3, 4, 3).local_world_size == 4  # nothing said about nodes: one node


@pytest.mark.parametrize("sizes,nodes", [("8,7", (8, 7)), ("2(x2),1", (2, 2, 1))])
def test_uneven_nodes(sizes, nodes):
    """Each node reads its own count; every rank finds the same nodes, hosts and layout errors."""
    assert slurm_tasks_per_node(sizes) == nodes
    world, firsts = sum(nodes), [sum(nodes[:i]) for i in range(len(nodes))]
    launches = [slurm(first, world, 0, tasks_per_node=sizes, nnodes=len(nodes), nodeid=node)
                for node, first in enumerate(firsts)]
    assert [launch.local_world_size for launch in launches] == list(nodes)
    for launch in launches:
        assert launch.num_nodes == len(nodes)
        assert [launch.node_of(r) for r in range(world)] == \
            [node for node, size in enumerate(nodes) for _ in range(size)]
        assert not launch.one_host([firsts[-1] - 1, firsts[-1]])
        assert check_layout(RankGrid(dp=world), launch) == []


def test_uneven_nodes_refuse_a_split_tp_group_alike():
    """Nodes of 3 and 1 with tp 2: the TP group [2, 3] spans them; both nodes say the same line."""
    lines = set()
    for node, first in ((0, 0), (1, 3)):
        launch = slurm(first, 4, 0, tasks_per_node="3,1", nnodes=2, nodeid=node)
        with pytest.raises(LayoutError) as exc:
            check_layout(RankGrid(tp=2, dp=2), launch)
        lines.add(str(exc.value))
    assert lines == {"a TP group of 2 ranks would span nodes of 1/3 processes (LOCAL_WORLD_SIZE); "
                     "make --tp divide the processes per node"}


def test_unreadable_tasks_per_node_is_ignored():
    assert slurm_tasks_per_node("8(x2") == () and slurm_tasks_per_node("") == ()
    assert slurm(0, 16, 0, tasks_per_node="eight", nnodes=2).local_world_size == 8
