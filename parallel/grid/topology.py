"""Rank-grid arithmetic: pure Python, no torch.distributed.

A job of ``world = tp * cp * pp * dp`` ranks is laid out on a 4-D grid. ``order`` names the
dimensions from fastest- to slowest-varying, so with the default ``"tp-cp-dp-pp"`` the ranks of one
tensor-parallel group are consecutive (they share a node and its fast links), context parallelism
comes next, then data parallelism, and pipeline stages are the outermost (across nodes). An order
that leaves out ``cp`` (the three-dimension spelling, e.g. ``"tp-dp-pp"``) places it right after
``tp``; with cp=1 it changes nothing.

Worked example, 16 ranks, ``RankGrid(tp=2, pp=2, dp=4)`` (cp=1)::

    rank = tp_idx + 2 * dp_idx + 8 * pp_idx
    TP groups: [0, 1], [2, 3], [4, 5], ..., [14, 15]
    DP groups: [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]
    PP groups: [0, 8], [1, 9], [2, 10], ..., [7, 15]
    coord(13) == Coord(tp=1, pp=1, dp=2, cp=0)      # 13 = 1 + 2*2 + 8*1

With context parallelism, 16 ranks, ``RankGrid(tp=2, cp=2, pp=2, dp=2)``::

    rank = tp_idx + 2 * cp_idx + 4 * dp_idx + 8 * pp_idx
    CP groups: [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], ...
    DP groups: [0, 4], [1, 5], [2, 6], [3, 7], [8, 12], ...
    DP x CP groups ("dp_cp", where gradients of CP-replicated parameters are reduced):
               [0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]
    coord(13) == Coord(tp=1, pp=1, dp=1, cp=0)      # 13 = 1 + 0*2 + 1*4 + 1*8

Model-parallel ("mp") groups are the TP x PP ranks that hold one full model replica for one CP and
DP position ([0, 1, 8, 9], ... in the first example), and embedding groups join the first and last
stage of each pipeline ([0, 8], ... for pp=2; a single rank when pp=1).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

DIMS = ("tp", "cp", "pp", "dp")
DEFAULT_ORDER = "tp-cp-dp-pp"


class Coord(NamedTuple):
    tp: int
    pp: int
    dp: int
    cp: int = 0


def normalise_order(order: str) -> list[str]:
    """The four dimension names of ``order`` (``cp`` inserted after ``tp`` when it is left out)."""
    names = order.split("-")
    if "cp" not in names and "tp" in names:
        names.insert(names.index("tp") + 1, "cp")
    if sorted(names) != sorted(DIMS):
        raise ValueError(
            f"RankGrid: order must name tp, cp, pp and dp once each (cp may be left out), "
            f"separated by '-', got {order!r} (for example '{DEFAULT_ORDER}' or 'tp-dp-pp')")
    return names


@dataclass(frozen=True)
class RankGrid:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = DEFAULT_ORDER
    cp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"RankGrid: {name} must be a positive integer, got {size!r}")
        normalise_order(self.order)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def _names(self) -> list[str]:
        return normalise_order(self.order)

    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each dimension."""
        strides, stride = {}, 1
        for name in self._names:
            strides[name] = stride
            stride *= getattr(self, name)
        return strides

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0, cp: int = 0) -> int:
        """Global rank at the given coordinates."""
        s = self.strides()
        return tp * s["tp"] + cp * s["cp"] + pp * s["pp"] + dp * s["dp"]

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
        """Every group of one dimension ("tp", "cp", "pp", "dp", "dp_cp", "mp" or "embedding"),
        in rank order."""
        if dim == "mp":
            return self._groups_varying(("tp", "pp"))
        if dim == "dp_cp":
            return self._groups_varying(("dp", "cp"))
        if dim == "embedding":
            return [sorted({g[0], g[-1]}) for g in self.groups("pp")]
        if dim not in DIMS:
            raise ValueError(f"RankGrid: unknown dimension {dim!r}; use tp, cp, pp, dp, dp_cp, mp "
                             f"or embedding")
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
        """The group of ``dim`` that holds ``rank`` (computed directly, without listing all)."""
        c = self.coord(rank)._asdict()
        varying = {"mp": ("tp", "pp"), "dp_cp": ("dp", "cp")}.get(dim, (dim,))
        if dim == "embedding":
            pp = self.group_of(rank, "pp")
            if rank not in (pp[0], pp[-1]):
                raise ValueError(f"RankGrid: rank {rank} is a middle pipeline stage, in no embedding group")
            return sorted({pp[0], pp[-1]})
        if any(v not in DIMS for v in varying):
            raise ValueError(f"RankGrid: unknown dimension {dim!r}")
        ranks = []
        for vals in product(*(range(getattr(self, d)) for d in varying)):
            ranks.append(self.rank_of(**{**c, **dict(zip(varying, vals))}))
        return sorted(ranks)

    def describe(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        order = "-".join(self._names) if self.cp > 1 else "-".join(n for n in self._names if n != "cp")
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return f"tp={self.tp}{cp} pp={self.pp} dp={self.dp} (order {order}, {ranks})"
