"""ParallelState: the process groups of one rank, cut from a RankGrid.

Built once per process and handed explicitly to every layer, schedule and reducer that needs it;
nothing here is module-level state. With ``world_size == 1`` no process group is created and every
group is a single-rank ``CommGroup`` (whose collectives are no-ops).
"""
from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.comm import CommGroup, CommMonitor, single_rank_group
from parallel.topology import Coord, RankGrid


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says what to change."""


@dataclass
class LaunchEnv:
    """Where this process sits in the job, read from torchrun or Slurm variables."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LaunchEnv":
        env = dict(os.environ if env is None else env)
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            return cls(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", world)))
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            world = int(env["SLURM_NTASKS"])
            per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or world
            return cls(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), per_node)
        return cls()

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def check_layout(grid: RankGrid, launch: LaunchEnv) -> list[str]:
    """Raise LayoutError for a grid that cannot run on this launch; return warnings.

    Pure: runs before any collective, identically on every rank.
    """
    if grid.world_size != launch.world_size:
        cp = f"*{grid.cp}" if grid.cp > 1 else ""
        raise LayoutError(
            f"world size {launch.world_size} != tp*{'cp*' if cp else ''}pp*dp = {grid.tp}{cp}*"
            f"{grid.pp}*{grid.dp} = {grid.world_size}; launch {grid.world_size} processes or change "
            f"--tp/--cp/--pp/--dp")
    notes = []
    per_node = launch.local_world_size
    if launch.world_size > 1 and per_node < launch.world_size:
        if grid.order.split("-")[0] == "tp" and per_node % grid.tp != 0:
            raise LayoutError(
                f"a TP group of {grid.tp} ranks would span nodes of {per_node} processes "
                f"(LOCAL_WORLD_SIZE); make --tp divide the processes per node")
        for group in grid.groups("tp"):
            if len({r // per_node for r in group}) > 1:
                raise LayoutError(
                    f"TP group {group} spans nodes of {per_node} processes (LOCAL_WORLD_SIZE); "
                    f"keep tp inside a node: use order tp-cp-dp-pp and tp <= {per_node}")
        nodes = launch.num_nodes
        if grid.pp > 1 and grid.pp % nodes != 0 and nodes % grid.pp != 0:
            notes.append(
                f"{grid.pp} pipeline stages do not divide evenly over {nodes} nodes; the recipe "
                f"advises placing stages so that each node holds whole stages")
    return notes


GROUP_DIMS = ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding")


@dataclass
class ParallelState:
    """This rank's place in the grid and its process groups, one ``CommGroup`` per dimension.

    Every group exists on every rank (a single-rank ``CommGroup`` when the dimension has size 1), so
    callers never test for None: a collective on a group of one rank is a no-op. All groups share
    one ``CommMonitor`` (``ps.comm``): the backend rules every collective is checked against and
    the byte counters per group kind.
    """
    grid: RankGrid
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    comm: CommMonitor = field(default_factory=CommMonitor)
    tp_group: CommGroup = None
    cp_group: CommGroup = None
    pp_group: CommGroup = None
    dp_group: CommGroup = None
    dp_cp_group: CommGroup = None      # DP x CP: where gradients of replicated parameters are summed
    mp_group: CommGroup = None
    embedding_group: CommGroup = None
    world_group: CommGroup = None
    owns_process_group: bool = False

    def __post_init__(self) -> None:
        for dim in GROUP_DIMS:
            if getattr(self, f"{dim}_group") is None:
                setattr(self, f"{dim}_group", single_rank_group(dim, self.rank, self.comm))
        if self.world_group is None:
            self.world_group = CommGroup("world", tuple(range(self.grid.world_size)), self.rank,
                                         None, self.comm, world=True)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def serial(cls, device: torch.device | str = "cpu", backend_rules: str | None = None) -> "ParallelState":
        return cls(RankGrid(1, 1, 1), device=torch.device(device), comm=CommMonitor(backend_rules))

    @classmethod
    def initialize(cls, grid: RankGrid, device: torch.device, backend: str,
                   launch: LaunchEnv | None = None, timeout_s: float = 300.0,
                   backend_rules: str | None = None) -> "ParallelState":
        """Join (or start) the default process group and create every group of the grid.

        ``device`` must already be bound by LOCAL_RANK (the device module does that); on NCCL it is
        passed as ``device_id`` so communicators can be split for subgroups. Groups of all
        dimensions are created in the same order on every rank, as torch.distributed requires.
        ``backend_rules`` ("hccl", "hccl:950", "nccl" or None) is what every collective is checked
        against (see parallel/backend_rules.py).
        """
        launch = launch or LaunchEnv.from_env()
        for note in check_layout(grid, launch):
            if launch.rank == 0:
                warnings.warn(note)
        monitor = CommMonitor(backend_rules)
        if grid.world_size == 1 and not dist.is_initialized():
            return cls(grid, rank=launch.rank, local_rank=launch.local_rank,
                       device=torch.device(device), backend=backend, comm=monitor)
        timeout = datetime.timedelta(seconds=timeout_s)
        owns = False
        if not dist.is_initialized():
            extra = {"device_id": torch.device(device)} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, init_method="env://", rank=launch.rank,
                                    world_size=launch.world_size, timeout=timeout, **extra)
            owns = True
        rank = dist.get_rank()
        groups = {}
        for dim in GROUP_DIMS:
            if dim == "dp_cp" and grid.cp == 1:
                continue                                   # the DP group itself (below)
            mine = None
            for ranks in grid.groups(dim):
                if len(ranks) == 1:
                    if rank in ranks:
                        mine = single_rank_group(dim, rank, monitor)
                    continue
                pg = dist.new_group(ranks, timeout=timeout, backend=backend)
                if rank in ranks:
                    mine = CommGroup(dim, tuple(ranks), ranks.index(rank), pg, monitor)
            groups[f"{dim}_group"] = mine
        if grid.cp == 1:
            groups["dp_cp_group"] = groups["dp_group"]
        return cls(grid, rank=rank, local_rank=launch.local_rank, device=torch.device(device),
                   backend=backend, comm=monitor, owns_process_group=owns, **groups)

    def destroy(self) -> None:
        """Tear down cleanly: barrier so no peer is mid-collective, then destroy the groups."""
        if dist.is_initialized():
            self.world_group.barrier()
            if self.owns_process_group:
                dist.destroy_process_group()

    # ---- coordinates --------------------------------------------------------------------
    @property
    def coord(self) -> Coord:
        cached = self.__dict__.get("_coord")
        if cached is None or cached[0] != self.rank:  # derived from the rank: computed once
            cached = (self.rank, self.grid.coord(self.rank))
            self.__dict__["_coord"] = cached
        return cached[1]

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    tp_size = property(lambda self: self.grid.tp)
    cp_size = property(lambda self: self.grid.cp)
    pp_size = property(lambda self: self.grid.pp)
    dp_size = property(lambda self: self.grid.dp)
    tp_rank = property(lambda self: self.coord.tp)
    cp_rank = property(lambda self: self.coord.cp)
    pp_rank = property(lambda self: self.coord.pp)
    dp_rank = property(lambda self: self.coord.dp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the given pipeline stage in this rank's pipeline."""
        c = self.coord
        return self.grid.rank_of(tp=c.tp, pp=pp_rank, dp=c.dp, cp=c.cp)

    def describe(self) -> str:
        c = self.coord
        cp = f", cp {c.cp}/{self.cp_size}" if self.cp_size > 1 else ""
        return (f"rank {self.rank} (tp {c.tp}/{self.tp_size}{cp}, pp {c.pp}/{self.pp_size}, "
                f"dp {c.dp}/{self.dp_size})")
