"""ParallelState: the process groups of one rank, cut from a RankGrid.

Built once per process and handed explicitly to every layer, schedule and reducer that needs it;
nothing here is module-level state. With ``world_size == 1`` no process group is created and every
group is a single-rank ``CommGroup`` (whose collectives are no-ops).
"""
from __future__ import annotations

import datetime
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.runtime.comm import CommGroup, single_rank_group
from parallel.runtime.comm_monitor import CommMonitor
from parallel.runtime.lanes import EXCHANGE_LANE
from parallel.grid.launch import LaunchEnv, check_layout
from parallel.grid.rendezvous import Rendezvous
from parallel.grid.topology import Coord, RankGrid


GROUP_DIMS = ("tp", "cp", "pp", "dp", "dp_cp", "mp", "embedding")


@dataclass
class ParallelState:
    """This rank's place in the grid and its process groups, one ``CommGroup`` per dimension.

    Every group exists on every rank (a single-rank ``CommGroup`` when the dimension has size 1), so
    callers never test for None: a collective on a group of one rank is a no-op. All groups share
    one ``CommMonitor`` (``ps.comm``): the backend rules every collective is checked against and
    the byte counters per group kind.

    ``dp_exchange_group``: the DP x CP ranks on a communicator of the exchange worker's own
    (parallel/runtime/lanes.py), of ``dp_cp_group``'s kind; made only with
    ``initialize(dp_exchange=True)`` (gradient compression: the planner counts its buffers then) or
    when it has one rank. ``edp_exchange_group``: the expert-data-parallel ranks on the same lane,
    for compressed expert buckets (``init_expert_groups(..., exchange=True)``).
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
    dp_exchange_group: CommGroup | None = None   # DP x CP on the exchange worker's lane
    ep_group: CommGroup = None         # expert-parallel ranks (parallel/grid/expert_groups.py)
    edp_group: CommGroup = None        # expert-data-parallel: where expert gradients are summed
    etp_group: CommGroup = None        # expert-tensor-parallel: the TP group under ETP, else this rank
    # EDP on the exchange worker's lane (init_expert_groups(..., exchange=True)): compressed expert
    # buckets; without expert parallelism it is dp_exchange_group
    edp_exchange_group: CommGroup | None = None
    owns_process_group: bool = False

    def __post_init__(self) -> None:
        for dim in GROUP_DIMS:
            if getattr(self, f"{dim}_group") is None:
                setattr(self, f"{dim}_group", single_rank_group(dim, self.rank, self.comm))
        if self.dp_exchange_group is None and self.dp_cp_group.size == 1:
            self.dp_exchange_group = single_rank_group(self.dp_cp_group.kind, self.rank, self.comm)
            self.dp_exchange_group.lane = EXCHANGE_LANE
        if self.ep_group is None:  # no expert parallelism: experts are replicated like the rest
            self.ep_group = single_rank_group("ep", self.rank, self.comm)
        if self.edp_group is None:  # parallel.expert_parallel.init_expert_groups sets both
            self.edp_group = self.dp_cp_group
        if self.edp_exchange_group is None and self.edp_group is self.dp_cp_group:
            self.edp_exchange_group = self.dp_exchange_group
        if self.etp_group is None:  # each expert whole on one rank (init_expert_groups' etp)
            self.etp_group = single_rank_group("tp", self.rank, self.comm)
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
                   backend_rules: str | None = None,
                   agreement: dict[str, str] | None = None,
                   dp_exchange: bool = False, say_notes: bool = True) -> "ParallelState":
        """Join (or start) the default process group and create every group of the grid.

        ``device`` must already be bound by LOCAL_RANK (the device module does that); on NCCL it is
        passed as ``device_id`` so communicators can be split for subgroups. Groups of all
        dimensions are created in the same order on every rank, as torch.distributed requires.
        ``backend_rules`` ("hccl", "hccl:950", "nccl" or None) is what every collective is checked
        against (see parallel/runtime/backend_rules.py). Before the process group (or, when one
        exists already, before the first collective with an ``agreement``) the ranks meet on the
        rendezvous store (``Rendezvous.agree``): a rank that never comes, a rank that stopped on
        an error and ranks whose ``agreement`` differs are named within ``timeout_s``.
        ``dp_exchange`` also creates ``dp_exchange_group`` (needed by gradient compression), last,
        so that every rank creates the same groups in the same order; it cannot be made later.
        ``say_notes``: warn ``check_layout``'s notes on rank 0 (False: the caller says them).
        """
        launch = launch or LaunchEnv.from_env()
        for note in check_layout(grid, launch):
            if launch.rank == 0 and say_notes:
                warnings.warn(note)
        monitor = CommMonitor(backend_rules)
        if grid.world_size == 1 and not dist.is_initialized():
            return cls(grid, rank=launch.rank, local_rank=launch.local_rank,
                       device=torch.device(device), backend=backend, comm=monitor)
        timeout = datetime.timedelta(seconds=timeout_s)
        owns = False
        if not dist.is_initialized():
            meeting = Rendezvous.open(launch, timeout_s)
            meeting.agree(agreement)
            extra = {"device_id": torch.device(device)} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, store=meeting.store, rank=launch.rank,
                                    world_size=launch.world_size, timeout=timeout, **extra)
            owns = True
        elif agreement is not None:
            Rendezvous.open(launch, timeout_s).agree(agreement)
        rank = dist.get_rank()

        def create(dim: str, lane: str | None = None) -> CommGroup:
            """Every group of ``dim`` (new_group is collective), in grid order; this rank's."""
            mine = None
            for ranks in grid.groups(dim):
                if len(ranks) == 1:
                    if rank in ranks:
                        mine = single_rank_group(dim, rank, monitor)
                    continue
                pg = dist.new_group(ranks, timeout=timeout, backend=backend)
                if rank in ranks:
                    mine = CommGroup(dim, tuple(ranks), ranks.index(rank), pg, monitor)
            if lane is not None:
                mine.lane = lane
            return mine

        groups = {f"{dim}_group": create(dim) for dim in GROUP_DIMS
                  if not (dim == "dp_cp" and grid.cp == 1)}   # with cp 1: the DP group itself
        if grid.cp == 1:
            groups["dp_cp_group"] = groups["dp_group"]
        if dp_exchange:
            groups["dp_exchange_group"] = create("dp_cp" if grid.cp > 1 else "dp", EXCHANGE_LANE)
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
