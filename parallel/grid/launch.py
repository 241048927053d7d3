"""Where a process sits in the job (``LaunchEnv``, from torchrun or Slurm) and whether a rank grid
can run there (``check_layout``): pure, before any collective."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from parallel.grid.topology import RankGrid


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says what to change."""


@dataclass
class LaunchEnv:
    """Where this process sits in the job, read from torchrun or Slurm variables. ``node_sizes``:
    the processes on each node in node order, where the launcher says (Slurm); empty means
    every node holds ``local_world_size``. ``job_id``: which job this launch belongs to, the same in
    every process of it and on every restart of it (``from_env``); None for a plain process, which
    no launcher restarts."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_sizes: tuple[int, ...] = ()
    job_id: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LaunchEnv":
        """torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. Slurm (srun): SLURM_PROCID,
        SLURM_NTASKS, SLURM_LOCALID; the processes on this node from this node's (SLURM_NODEID)
        entry of SLURM_TASKS_PER_NODE, which srun sets for every step ("8(x2),7": two nodes of 8,
        then one of 7; used where its counts add up to SLURM_NTASKS), else SLURM_NTASKS_PER_NODE
        (--ntasks-per-node), else SLURM_NTASKS / SLURM_NNODES. ``job_id``: torchrun's run id
        (TORCHELASTIC_RUN_ID: its --rdzv-id, drawn anew for each --standalone or single-node launch
        and kept across the restarts of --max-restarts; not its default "none", which every launch
        shares), else Slurm's job id (SLURM_JOB_ID, kept by a requeue), else None.

        >>> [LaunchEnv.from_env(e).job_id for e in ({"TORCHELASTIC_RUN_ID": "none",
        ...     "SLURM_JOB_ID": "42"}, {"TORCHELASTIC_RUN_ID": "a1", "SLURM_JOB_ID": "42"}, {})]
        ['slurm:42', 'torchrun:a1', None]
        """
        env = dict(os.environ if env is None else env)
        run, slurm_job = env.get("TORCHELASTIC_RUN_ID", "").strip(), env.get("SLURM_JOB_ID", "").strip()
        job = f"torchrun:{run}" if run and run != "none" else f"slurm:{slurm_job}" if slurm_job else None
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            return cls(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", world)), job_id=job)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            world = int(env["SLURM_NTASKS"])
            sizes = slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
            if sum(sizes) != world:
                sizes = ()  # not this job step's layout
            node = int(env.get("SLURM_NODEID", 0) or 0)
            nodes = int(env.get("SLURM_NNODES", 0) or 0)
            per_node = sizes[node] if 0 <= node < len(sizes) else \
                int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0)
            if not per_node and nodes > 0:
                per_node = max(1, world // nodes)
            return cls(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                       min(per_node, world) or world, sizes if len(set(sizes)) > 1 else (), job)
        return cls(job_id=job)

    @property
    def num_nodes(self) -> int:
        if self.node_sizes:
            return len(self.node_sizes)
        return max(1, self.world_size // max(1, self.local_world_size))

    def node_of(self, rank: int) -> int:
        """The node that holds global ``rank``: torchrun and Slurm's block distribution put ranks
        node-major (node i holds the next ``node_sizes[i]`` ranks, L each on even nodes).

        >>> LaunchEnv(0, 16, 0, 8).node_of(7), LaunchEnv(0, 15, 0, 8, (8, 7)).node_of(8)
        (0, 1)
        """
        if self.node_sizes:
            first = 0
            for node, size in enumerate(self.node_sizes):
                first += size
                if rank < first:
                    return node
            return len(self.node_sizes) - 1
        return rank // max(1, self.local_world_size)

    def one_host(self, ranks) -> bool:
        """Whether global ``ranks`` run on one host (``node_of``).

        >>> LaunchEnv(0, 16, 0, 8).one_host([0, 7]), LaunchEnv(0, 16, 0, 8).one_host([7, 8])
        (True, False)
        """
        return len({self.node_of(r) for r in ranks}) <= 1


def slurm_tasks_per_node(value: str) -> tuple[int, ...]:
    """The processes on each node from Slurm's SLURM_TASKS_PER_NODE (() when it cannot be read).

    >>> slurm_tasks_per_node("8(x2)"), slurm_tasks_per_node("2(x2),1"), slurm_tasks_per_node("")
    ((8, 8), (2, 2, 1), ())
    """
    sizes: list[int] = []
    for entry in filter(None, value.replace(" ", "").split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", entry)
        if match is None:
            return ()
        sizes += [int(match.group(1))] * int(match.group(2) or 1)
    return tuple(sizes)


def check_layout(grid: RankGrid, launch: LaunchEnv) -> list[str]:
    """Raise LayoutError for a grid that cannot run on this launch; return warnings.

    Pure: runs before any collective, identically on every rank (uneven Slurm nodes: from the
    node sizes every rank reads alike).
    """
    if grid.world_size != launch.world_size:
        cp = f"*{grid.cp}" if grid.cp > 1 else ""
        raise LayoutError(
            f"world size {launch.world_size} != tp*{'cp*' if cp else ''}pp*dp = {grid.tp}{cp}*"
            f"{grid.pp}*{grid.dp} = {grid.world_size}; launch {grid.world_size} processes or change "
            f"--tp/--cp/--pp/--dp")
    notes = []
    nodes = launch.num_nodes
    if launch.world_size > 1 and (nodes > 1 or launch.local_world_size < launch.world_size):
        sizes = sorted(set(launch.node_sizes or (launch.local_world_size,)))
        per_node = "/".join(map(str, sizes))
        if grid.order.split("-")[0] == "tp" and any(size % grid.tp for size in sizes):
            raise LayoutError(
                f"a TP group of {grid.tp} ranks would span nodes of {per_node} processes "
                f"(LOCAL_WORLD_SIZE); make --tp divide the processes per node")
        for group in grid.groups("tp"):
            if not launch.one_host(group):
                raise LayoutError(
                    f"TP group {group} spans nodes of {per_node} processes (LOCAL_WORLD_SIZE); "
                    f"keep tp inside a node: use order tp-cp-dp-pp and tp <= {min(sizes)}")
        if grid.pp > 1 and grid.pp % nodes != 0 and nodes % grid.pp != 0:
            notes.append(
                f"{grid.pp} pipeline stages do not divide evenly over {nodes} nodes; the recipe "
                f"advises placing stages so that each node holds whole stages")
    return notes
