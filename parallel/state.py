"""ParallelState: the process groups of one rank, cut from a RankGrid.

Built once per process and handed explicitly to every layer, schedule and reducer that needs it;
nothing here is module-level state. With ``world_size == 1`` no process group is created and every
group is ``None`` (communication helpers treat a ``None`` group of size 1 as a no-op).
"""
from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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
        raise LayoutError(
            f"world size {launch.world_size} != tp*pp*dp = {grid.tp}*{grid.pp}*{grid.dp} = "
            f"{grid.world_size}; launch {grid.world_size} processes or change --tp/--pp/--dp")
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
                    f"keep tp inside a node: use order tp-dp-pp and tp <= {per_node}")
        nodes = launch.num_nodes
        if grid.pp > 1 and grid.pp % nodes != 0 and nodes % grid.pp != 0:
            notes.append(
                f"{grid.pp} pipeline stages do not divide evenly over {nodes} nodes; the recipe "
                f"advises placing stages so that each node holds whole stages")
    return notes


@dataclass
class ParallelState:
    grid: RankGrid
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    mp_group: object = None
    embedding_group: object = None
    owns_process_group: bool = False

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def serial(cls, device: torch.device | str = "cpu") -> "ParallelState":
        return cls(RankGrid(1, 1, 1), device=torch.device(device))

    @classmethod
    def initialize(cls, grid: RankGrid, device: torch.device, backend: str,
                   launch: LaunchEnv | None = None, timeout_s: float = 300.0) -> "ParallelState":
        """Join (or start) the default process group and create every group of the grid.

        ``device`` must already be bound by LOCAL_RANK (the device module does that). Groups of all
        dimensions are created in the same order on every rank, as torch.distributed requires.
        """
        launch = launch or LaunchEnv.from_env()
        for note in check_layout(grid, launch):
            if launch.rank == 0:
                warnings.warn(note)
        state = cls(grid, rank=launch.rank, local_rank=launch.local_rank,
                    device=torch.device(device), backend=backend)
        if grid.world_size == 1 and not dist.is_initialized():
            return state
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, init_method="env://", rank=launch.rank,
                                    world_size=launch.world_size, timeout=timeout)
            state.owns_process_group = True
        state.rank = dist.get_rank()
        for dim in ("tp", "pp", "dp", "mp", "embedding"):
            mine = None
            for ranks in grid.groups(dim):
                group = dist.new_group(ranks, timeout=timeout, backend=backend)
                if state.rank in ranks:
                    mine = group
            setattr(state, f"{dim}_group", mine)
        return state

    def destroy(self) -> None:
        """Tear down cleanly: barrier so no peer is mid-collective, then destroy the groups."""
        if dist.is_initialized():
            dist.barrier()
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
    pp_size = property(lambda self: self.grid.pp)
    dp_size = property(lambda self: self.grid.dp)
    tp_rank = property(lambda self: self.coord.tp)
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
        return self.grid.rank_of(tp=c.tp, pp=pp_rank, dp=c.dp)

    def describe(self) -> str:
        c = self.coord
        return f"rank {self.rank} (tp {c.tp}/{self.tp_size}, pp {c.pp}/{self.pp_size}, dp {c.dp}/{self.dp_size})"
