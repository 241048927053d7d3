"""Rank-grid arithmetic: pure Python, no torch.distributed.

A job of ``world = tp * pp * dp`` ranks is laid out on a 3-D grid. ``order`` names the three
dimensions from fastest- to slowest-varying, so with the default ``"tp-dp-pp"`` the ranks of one
tensor-parallel group are consecutive (they share a node and its fast links), data parallelism
comes next and pipeline stages are the outermost (across nodes).

Worked example, 16 ranks, ``RankGrid(tp=2, pp=2, dp=4)``::

    rank = tp_idx + 2 * dp_idx + 8 * pp_idx
    TP groups: [0, 1], [2, 3], [4, 5], ..., [14, 15]
    DP groups: [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]
    PP groups: [0, 8], [1, 9], [2, 10], ..., [7, 15]
    coord(13) == Coord(tp=1, pp=1, dp=2)      # 13 = 1 + 2*2 + 8*1

Model-parallel ("mp") groups are the TP x PP ranks that hold one full model replica
([0, 1, 8, 9], ...), and embedding groups join the first and last stage of each pipeline
([0, 8], ... for pp=2; a single rank when pp=1).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

DIMS = ("tp", "pp", "dp")


class Coord(NamedTuple):
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class RankGrid:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        for name in DIMS:
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"RankGrid: {name} must be a positive integer, got {size!r}")
        names = self.order.split("-")
        if sorted(names) != sorted(DIMS):
            raise ValueError(
                f"RankGrid: order must name tp, pp and dp once each, separated by '-', "
                f"got {self.order!r} (for example 'tp-dp-pp')")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def _names(self) -> list[str]:
        return self.order.split("-")

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for name in self._names:
            strides[name] = stride
            stride *= getattr(self, name)
        return strides

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """Global rank at the given coordinates."""
        s = self._strides()
        return tp * s["tp"] + pp * s["pp"] + dp * s["dp"]

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"RankGrid: rank {rank} outside a world of {self.world_size}")
        values, rest = {}, rank
        for name in self._names:
            size = getattr(self, name)
            values[name] = rest % size
            rest //= size
        return Coord(**values)

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of one dimension ("tp", "pp", "dp", "mp" or "embedding"), in rank order."""
        if dim == "mp":
            return self._groups_varying(("tp", "pp"))
        if dim == "embedding":
            return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
        if dim not in DIMS:
            raise ValueError(f"RankGrid: unknown dimension {dim!r}; use tp, pp, dp, mp or embedding")
        return self._groups_varying((dim,))

    def _groups_varying(self, varying: tuple[str, ...]) -> list[list[int]]:
        fixed = [d for d in DIMS if d not in varying]
        found = []
        for fixed_vals in product(*(range(getattr(self, d)) for d in fixed)):
            base = dict(zip(fixed, fixed_vals))
            ranks = sorted(
                self.rank_of(**base, **dict(zip(varying, var_vals)))
                for var_vals in product(*(range(getattr(self, d)) for d in varying)))
            found.append(ranks)
        return sorted(found)

    def group_of(self, rank: int, dim: str) -> list[int]:
        for group in self.groups(dim):
            if rank in group:
                return group
        raise ValueError(f"RankGrid: rank {rank} is in no {dim} group")

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} (order {self.order}, {self.world_size} ranks)"
