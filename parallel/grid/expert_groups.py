"""Expert-parallel rank arithmetic: pure Python, no torch.distributed.

A mixture-of-experts layer refolds the ranks of its pipeline stage (parallel folding, as in
Megatron-Core) into expert-tensor-parallel (ETP), expert-parallel (EP) and expert-data-parallel
(EDP) groups. ETP is 1 or tp (the ETP groups are then the TP groups: every TP rank holds 1/tp of
each of its experts, models/moe/experts.py), and the folding is drawn from the DP x CP ranks at
equal tp and pp coordinates: each of those ``dp_cp`` groups (``RankGrid.groups("dp_cp")``, its
ranks in rank order) is cut into consecutive blocks of ``ep`` ranks (the EP groups: the ranks that
exchange tokens and hold disjoint experts), and the ranks at the same position of every block form
an EDP group (the replicas of one set of experts, where their gradients are summed). So
EP x EDP = dp x cp, and with ETP = 1 each TP rank of a stage holds an identical replica of its
experts (with ETP = tp its slice of them; the TP ranks route and dispatch the same tokens). Without
sequence parallelism the tokens of a TP group are the same; with it each TP rank dispatches its
own sequence shard through the EP group of its tp coordinate, and the replicas' gradients are
summed over TP (models/moe/layer.py). Under context parallelism the EP ranks may be CP ranks of
one data-parallel rank, each holding a slice of every sequence.

With ``RankGrid(tp=2, cp=2)`` and ``ep=2``: DP x CP groups [0, 2], [1, 3] (the CP pairs), so EP
[0, 2], [1, 3] and EDP [0], [1], [2], [3].

Worked example, 8 ranks, ``RankGrid(tp=2, dp=4)`` with ``ep=2``::

    DP groups  [0, 2, 4, 6], [1, 3, 5, 7]
    EP groups  [0, 2], [1, 3], [4, 6], [5, 7]     # consecutive pairs of each DP group
    EDP groups [0, 4], [1, 5], [2, 6], [3, 7]     # the same position in every pair
    ETP groups [0], [1], ..., [7]                 # etp = 1
    ETP groups [0, 1], [2, 3], [4, 5], [6, 7]     # etp = 2: the TP groups
    expert_rank(6) == 1: rank 6 holds experts E/2 .. E-1 of every MoE layer (etp 2: their first
                         halves of fc1 rows and fc2 columns, rank 7 the second)

With ``RankGrid(dp=2)`` and ``ep=2``: EP [0, 1], EDP [0], [1] (every expert lives on one rank).
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.grid.topology import RankGrid

EXPERT_DIMS = ("ep", "edp", "etp")


@dataclass(frozen=True)
class ExpertGrid:
    grid: RankGrid
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("ep", "etp"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"--expert-{'model' if name == 'ep' else 'tensor'}-parallel-size "
                                 f"must be a positive integer, got {size!r}")
        if self.etp not in (1, self.grid.tp):
            raise ValueError(f"--expert-tensor-parallel-size {self.etp}: only 1 (each expert whole "
                             f"on one rank) or --tp {self.grid.tp} (the TP group splits every "
                             f"expert) is built")
        dp_cp = self.grid.dp * self.grid.cp
        if dp_cp % self.ep:
            raise ValueError(f"--expert-model-parallel-size {self.ep} must divide dp x cp = "
                             f"{self.grid.dp} x {self.grid.cp} = {dp_cp}: expert-parallel ranks are "
                             f"drawn from the data- and context-parallel ranks of a stage")

    @property
    def edp(self) -> int:
        return self.grid.dp * self.grid.cp // self.ep

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` ("ep", "edp" or "etp"), in rank order."""
        if dim == "etp":
            return (self.grid.groups("tp") if self.etp > 1
                    else [[r] for r in range(self.grid.world_size)])
        if dim not in EXPERT_DIMS:
            raise ValueError(f"ExpertGrid: unknown dimension {dim!r}; use one of {EXPERT_DIMS}")
        found = []
        for ranks in self.grid.groups("dp_cp"):
            if dim == "ep":
                found += [ranks[i:i + self.ep] for i in range(0, len(ranks), self.ep)]
            else:
                found += [ranks[i::self.ep] for i in range(self.ep)]
        return sorted(found)

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The group of ``dim`` that holds ``rank``."""
        self.grid.coord(rank)  # range check
        return next(g for g in self.groups(dim) if rank in g)

    def expert_rank(self, rank: int) -> int:
        """``rank``'s index in its EP group: it holds experts [i * E/ep, (i + 1) * E/ep)."""
        return self.group_of(rank, "ep").index(rank)

    def ep_group_start(self, rank: int) -> int:
        """The position among its stage's DP x CP ranks (in rank order) of the first rank of
        ``rank``'s EP group, the groups being consecutive blocks of ``ep`` positions. Source j of
        the group is the rank at position ``start + j``, a CP slice of micro-batch (DP coordinate)
        ``(start + j) // micro_stride() % dp``: with ``RankGrid(dp=2, cp=2)`` (CP the faster) and
        ep 2, rank 3 (dp 1, cp 1) starts at 2, its sources are micro-batch 1's two slices; with
        order tp-dp-cp-pp (DP the faster) rank 3 is at position 3 too, but its group's sources are
        micro-batches 0 and 1 (cp slice 1 of each)."""
        ranks = next(g for g in self.grid.groups("dp_cp") if rank in g)
        return ranks.index(rank) // self.ep * self.ep

    def micro_stride(self) -> int:
        """Positions among a stage's DP x CP ranks (rank order) per step of the DP coordinate:
        cp where CP varies faster than DP in the rank order (the default), else 1."""
        strides = self.grid.strides()
        return self.grid.cp if strides["cp"] < strides["dp"] else 1

    @staticmethod
    def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
        """The global indices of the experts an EP rank holds."""
        if num_experts % ep:
            raise ValueError(f"--num-experts {num_experts} is not divisible by "
                             f"--expert-model-parallel-size {ep}; use a multiple of it")
        per = num_experts // ep
        return range(ep_rank * per, (ep_rank + 1) * per)
