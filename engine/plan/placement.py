"""Rank order and links: which devices a layout's groups span, and the bus bandwidth they get.

Pure arithmetic, no torch. The rank order is the run's (``--order``, docs/design.md: ``tp-cp-dp-pp``
by default): the first name varies fastest, so a dimension's stride is the product of the sizes
named before it, and rank = sum over dimensions of coordinate x stride. Nodes hold consecutive ranks
(node = rank // devices_per_node), as torchrun and Slurm hand them out.

Worked example, 16 ranks on nodes of 8, tp=2 cp=1 dp=4 pp=2, order tp-cp-dp-pp::

    strides   tp 1, cp 2, dp 2, pp 8          (cp=1 takes no room: its stride equals dp's)
    groups    tp [0, 1]    dp [0, 2, 4, 6]    pp [0, 8]    dp x cp [0, 2, 4, 6]
    nodes     tp in one node; dp in one node (4 members); pp over 2 nodes, 1 member each

The same layout in order tp-pp-dp: pp [0, 2] inside node 0, dp [0, 4, 8, 12] over two nodes with
two members on each.
"""
from __future__ import annotations

from functools import lru_cache
from itertools import product

DIMS = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"


def parse_order(order: str, cp: int = 1) -> tuple[str, ...]:
    """The order's names, fastest first, with ``cp`` inserted after ``tp`` when it is left out.

    Leaving cp out is allowed only for cp = 1 (today's engine orders name tp, dp and pp).
    """
    names = tuple(n.strip() for n in order.split("-"))
    if "cp" not in names:
        if cp != 1:
            raise ValueError(f"--order {order!r} does not place cp, but cp = {cp}; name it, e.g. "
                             f"{DEFAULT_ORDER!r}")
        names = names[:1] + ("cp",) + names[1:] if names[:1] == ("tp",) else names + ("cp",)
    if sorted(names) != sorted(DIMS):
        raise ValueError(f"--order must name tp, cp (optional when cp = 1), dp and pp once each, "
                         f"separated by '-', got {order!r} (for example {DEFAULT_ORDER!r})")
    return names


def engine_order(order: str, cp: int = 1) -> str:
    """The order string as the run's ``--order`` takes it: cp dropped when cp = 1."""
    names = parse_order(order, cp)
    return "-".join(n for n in names if n != "cp" or cp > 1)


def strides(order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Rank distance between neighbours of each dimension.

    >>> strides("tp-cp-dp-pp", {"tp": 2, "cp": 1, "dp": 4, "pp": 2})
    {'tp': 1, 'cp': 2, 'dp': 2, 'pp': 8}
    >>> strides("tp-pp-dp", {"tp": 8, "cp": 1, "dp": 32, "pp": 2})
    {'tp': 1, 'cp': 8, 'pp': 8, 'dp': 16}
    """
    out, stride = {}, 1
    for name in parse_order(order, sizes.get("cp", 1)):
        out[name] = stride
        stride *= sizes.get(name, 1)
    return out


@lru_cache(maxsize=4096)
def _group_of_rank0(order: str, tp: int, cp: int, dp: int, pp: int, dims: tuple[str, ...]) -> tuple[int, ...]:
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    st = strides(order, sizes)
    ranges = [range(sizes[d]) for d in dims]
    return tuple(sorted(sum(i * st[d] for i, d in zip(idx, dims)) for idx in product(*ranges)))


def group_of_rank0(order: str, sizes: dict[str, int], dims: tuple[str, ...]) -> tuple[int, ...]:
    """The ranks of rank 0's group over ``dims`` (all groups of a dimension are translates of it).

    >>> group_of_rank0("tp-cp-dp-pp", {"tp": 2, "cp": 1, "dp": 4, "pp": 2}, ("dp",))
    (0, 2, 4, 6)
    """
    return _group_of_rank0(order, sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("dp", 1),
                           sizes.get("pp", 1), tuple(dims))


def expert_groups_of_rank0(order: str, sizes: dict[str, int], ep: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(EP group, EDP group) of rank 0 (parallel/grid/expert_groups.py): its dp x cp group, in rank
    order, cut into consecutive blocks of ``ep`` ranks (the EP groups); the ranks at the same
    position of every block form an EDP group.

    >>> expert_groups_of_rank0("tp-cp-dp-pp", {"tp": 2, "cp": 1, "dp": 4, "pp": 1}, 2)
    ((0, 2), (0, 4))
    """
    dp_cp = group_of_rank0(order, sizes, ("cp", "dp"))
    return dp_cp[:ep], dp_cp[::ep]


def members_per_node(ranks: tuple[int, ...], devices_per_node: int) -> dict[int, int]:
    """{node: how many of ``ranks`` it holds}."""
    out: dict[int, int] = {}
    for r in ranks:
        out[r // devices_per_node] = out.get(r // devices_per_node, 0) + 1
    return out


@lru_cache(maxsize=4096)
def _all_groups_intra(order: str, tp: int, cp: int, dp: int, pp: int, dim: str, dpn: int) -> bool:
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    st = strides(order, sizes)
    span = st[dim] * (sizes[dim] - 1)
    others = [d for d in DIMS if d != dim]
    for idx in product(*(range(sizes[d]) for d in others)):
        start = sum(i * st[d] for i, d in zip(idx, others))
        if start // dpn != (start + span) // dpn:
            return False
    return True


def all_groups_intra(order: str, sizes: dict[str, int], dim: str, devices_per_node: int) -> bool:
    """True when every group of ``dim`` lies inside one node (checked for each group)."""
    return _all_groups_intra(order, sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("dp", 1),
                             sizes.get("pp", 1), dim, devices_per_node)


def collective_busbw(ranks: tuple[int, ...], devices_per_node: int, intra_gbps: float,
                     inter_gbps: float) -> float:
    """Bus bandwidth of a collective over ``ranks`` (GB/s, per device).

    Inside one node it is the intra-node rate. Across nodes a hierarchical ring moves each node's
    share over the NICs of the group's members on that node (k members use k per-device shares),
    capped by the intra-node rate; the node with the fewest members is the bottleneck.
    """
    nodes = members_per_node(ranks, devices_per_node)
    if len(nodes) == 1:
        return intra_gbps
    return min(intra_gbps, min(nodes.values()) * inter_gbps)


def p2p_gbps(ranks: tuple[int, ...], devices_per_node: int, intra_gbps: float,
             inter_gbps: float) -> float:
    """Per-device rate of a neighbour-to-neighbour exchange (pipeline p2p, the CP ring) along
    ``ranks``: intra-node when they share a node, else one device's network share (the slowest
    hop sets the pace; every device of a node sends through its own NIC share at once)."""
    return intra_gbps if len(members_per_node(ranks, devices_per_node)) == 1 else inter_gbps
