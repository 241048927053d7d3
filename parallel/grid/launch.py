"""Where a process sits in the job (``LaunchEnv``, from torchrun or Slurm) and whether a rank grid
can run there (``check_layout``): pure, before any collective."""
from __future__ import annotations

import os
from dataclasses import dataclass

from parallel.grid.topology import RankGrid


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

    def one_host(self, ranks) -> bool:
        """Whether global ``ranks`` run on one host (torchrun and Slurm's block distribution put
        ranks node-major: host i holds ranks i*L .. (i+1)*L - 1, L the local world size).

        >>> LaunchEnv(0, 16, 0, 8).one_host([0, 7]), LaunchEnv(0, 16, 0, 8).one_host([7, 8])
        (True, False)
        """
        per_host = max(1, self.local_world_size)
        return len({r // per_host for r in ranks}) <= 1


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
