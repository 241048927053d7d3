"""ParallelState: the process groups of one rank, cut from a RankGrid.

Built once per process and handed explicitly to every layer, schedule and reducer that needs it;
nothing here is module-level state. With ``world_size == 1`` no process group is created and every
group is a single-rank ``CommGroup`` (whose collectives are no-ops).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.runtime.comm import CommGroup, CommMonitor, single_rank_group
from parallel.runtime.lanes import EXCHANGE_LANE
from parallel.grid.topology import Coord, RankGrid


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


class RendezvousError(RuntimeError):
    """Ranks that did not reach the rendezvous within the timeout (the message names them)."""

    def __init__(self, message: str, arrived: tuple[int, ...] = ()):
        super().__init__(message)
        self.arrived = arrived  # the ranks that did arrive: the lowest of them reports it


class PeerStopped(LayoutError):
    """Another rank stopped on a configuration error before the process group existed; the
    lowest such rank (``rank``) reports ``message``, this one stops without a word."""

    def __init__(self, rank: int, message: str, meeting: "Rendezvous | None" = None):
        super().__init__(f"rank {rank} stopped: {message}")
        self.rank, self.message, self.meeting = rank, message, meeting


class Disagreement(LayoutError):
    """Ranks started with different configurations; every rank raises it and every rank reports it
    (engine/training/launch.py): each operator's log names the flags and ranks that differ."""

    def __init__(self, message: str, meeting: "Rendezvous | None" = None):
        super().__init__(message)
        self.meeting = meeting


RENDEZVOUS = "gridtron/rendezvous"
SHOWN_KEYS = 6  # differing keys a mismatch names per group of ranks


@dataclass
class Rendezvous:
    """The ranks' meeting on the rendezvous store before the first collective: every rank posts
    what it brings (a digest of its configuration, or the error it stopped on) and reads
    everyone's, so that a missing rank, a rank's configuration error and ranks started with
    different configurations are each named, on every rank, within the timeout, instead of a
    DistStoreError or a backend abort later. Each meeting has a namespace of its own (the n-th
    meeting of every rank is the same one).

    The store: the process group's when one exists, else torchrun's agent store (prefixed by
    TORCHELASTIC_RESTART_COUNT: an attempt never reads a dead attempt's keys), else a TCPStore at
    MASTER_ADDR:MASTER_PORT hosted by rank 0; ``init_process_group`` then runs on it.
    """
    store: object
    rank: int
    world_size: int
    timeout_s: float
    where: str
    hosts: bool = False  # this process serves the TCPStore: it leaves only once all have read
    deadline: float = 0.0
    name: str = RENDEZVOUS
    arrived: int = 0  # ranks whose entry the last exchange read

    @classmethod
    def open(cls, launch: LaunchEnv, timeout_s: float, env: dict | None = None) -> "Rendezvous":
        env = os.environ if env is None else env
        deadline = time.monotonic() + timeout_s
        if dist.is_initialized():
            store, where, hosts = dist.distributed_c10d._get_default_store(), "the process group's store", False
        else:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise LayoutError(f"{launch.world_size} ranks meet at MASTER_ADDR:MASTER_PORT, and "
                                  f"they are not set: start the job with torchrun (or set both)")
            addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
            agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            where, hosts = f"{addr}:{port}", not agent and launch.rank == 0
            try:
                if not hosts:  # wait here, not in TCPStore, whose timeout logs C++ stacks
                    _wait_for_listener(addr, port, deadline)
                store = dist.TCPStore(addr, port, launch.world_size, is_master=hosts,
                                      timeout=datetime.timedelta(seconds=timeout_s),
                                      wait_for_workers=False)
            except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError
                host = "torchrun's agent" if agent else "rank 0"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RendezvousError(
                    f"rank {launch.rank} found no rendezvous store at {where} within --timeout-s "
                    f"{timeout_s:g} s: {host}, which serves it, did not arrive (or cannot listen "
                    f"there); start it, or raise --timeout-s [{first}]", (launch.rank,)) from exc
            if agent:
                store = dist.PrefixStore(f"gridtron/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        call = store.add(f"{RENDEZVOUS}/calls/{launch.rank}", 1)
        return cls(store, launch.rank, launch.world_size, timeout_s, where, hosts, deadline,
                   f"{RENDEZVOUS}/{call}")

    def exchange(self, entry: dict, extra: str | None = None) -> dict[int, dict]:
        """Post ``entry`` (and ``extra``, read only on demand) and return every arrived rank's,
        waiting until all arrive or the deadline passes."""
        ns, store = self.name, self.store
        if extra is not None:
            store.set(f"{ns}/extra/{self.rank}", extra)
        store.set(f"{ns}/entry/{self.rank}", json.dumps(entry))
        store.add(f"{ns}/arrived", 1)
        delay = 0.005
        while store.add(f"{ns}/arrived", 0) < self.world_size and time.monotonic() < self.deadline:
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
        keys = [f"{ns}/entry/{r}" for r in range(self.world_size)]
        present = list(range(self.world_size)) if store.add(f"{ns}/arrived", 0) >= self.world_size             else [r for r in range(self.world_size) if store.check([keys[r]])]
        values = store.multi_get([keys[r] for r in present])
        self.arrived = len(present)
        return {r: json.loads(bytes(v).decode()) for r, v in zip(present, values)}

    def extra(self, rank: int) -> str:
        return bytes(self.store.get(f"{self.name}/extra/{rank}")).decode()

    def leave(self, arrived: int | None = None) -> None:
        """Say this rank has read all it needs. Before a failed meeting ends the process
        (``arrived``: how many ranks came), the store's host waits, bounded by the timeout,
        until they all have."""
        count = self.store.add(f"{self.name}/read", 1)
        end = time.monotonic() + self.timeout_s
        while self.hosts and arrived is not None and count < arrived and time.monotonic() < end:
            time.sleep(0.01)
            count = self.store.add(f"{self.name}/read", 0)

    def stop(self, message: str) -> int:
        """Meet the others with the error this rank stopped on; returns the lowest rank that
        reported one (the one that prints it: once, not once per rank)."""
        entries = self.exchange({"error": message})
        self.leave(len(entries))
        return min(r for r, e in entries.items() if e.get("error"))

    def agree(self, agreement: dict[str, str] | None) -> None:
        """Meet every rank with this rank's ``agreement`` ({key: text} every rank must share, e.g.
        the resolved flags); raise RendezvousError (a rank missing), PeerStopped (a rank
        reported an error) or LayoutError (ranks disagree: the keys and ranks)."""
        text = None if agreement is None else json.dumps(agreement, sort_keys=True)
        mine = None if text is None else hashlib.sha256(text.encode()).hexdigest()
        entries = self.exchange({"digest": mine}, text)
        failed = sorted(r for r, e in entries.items() if e.get("error"))
        if failed:
            self.leave(len(entries))
            raise PeerStopped(failed[0], entries[failed[0]]["error"], self)
        if len(entries) < self.world_size:
            self.leave(len(entries))
            missing = sorted(set(range(self.world_size)) - set(entries))
            raise RendezvousError(
                f"{_ranks(missing)} of {self.world_size} did not arrive at the rendezvous "
                f"({self.where}) within --timeout-s {self.timeout_s:g} s: start {'it' if len(missing) == 1 else 'them'} "
                f"(or check {'its' if len(missing) == 1 else 'their'} logs), or raise --timeout-s",
                tuple(sorted(entries)))
        groups: dict[str | None, list[int]] = {}
        for r in sorted(entries):
            groups.setdefault(entries[r]["digest"], []).append(r)
        if len(groups) > 1:
            message = self._disagreement(groups, entries[0]["digest"])
            self.leave(len(entries))
            raise Disagreement(message, self)
        self.leave()

    def _disagreement(self, groups: dict, reference: str | None) -> str:
        base = json.loads(self.extra(0)) if reference is not None else {}
        parts = []
        for digest, ranks in list(groups.items())[1:4]:
            theirs = json.loads(self.extra(ranks[0])) if digest is not None else {}
            keys = sorted(k for k in base.keys() | theirs.keys() if base.get(k) != theirs.get(k))
            shown = ", ".join(f"{k} {_value(theirs.get(k))} (rank 0: {_value(base.get(k))})"
                              for k in keys[:SHOWN_KEYS])
            more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
            parts.append(f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {shown}{more}")
        others = len(groups) - 4
        tail = f"; {others} more groups of ranks differ too" if others > 0 else ""
        return (f"ranks started with different configurations: {'; '.join(parts)}{tail}; start "
                f"every rank with the same flags and recipe")


def _wait_for_listener(addr: str, port: int, deadline: float) -> None:
    """Return once something listens at addr:port; TimeoutError at ``deadline``."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.05)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _value(text: str | None) -> str:
    if text is None:
        return "(unset)"
    value = json.loads(text)
    return value if isinstance(value, str) else text


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
