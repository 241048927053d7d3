"""Ring collectives' times at a bus bandwidth (nccl-tests' busbw convention), one latency each.

>>> round(allreduce_s(1e9, 8, 100.0), 6), round(gather_or_scatter_s(1e9, 8, 100.0), 6)
(0.01752, 0.00877)
>>> round(alltoall_s(1e9, (0, 8, 16, 24), 8, 200.0, 25.0), 6)  # 4 nodes: 3/4 of it leaves the node
0.03002
"""
from __future__ import annotations

from engine.plan.model import COLLECTIVE_LATENCY_S
from engine.plan.placement import members_per_node


def allreduce_s(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    """Ring all-reduce: every rank moves 2 (k-1)/k of the buffer at the bus bandwidth."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (busbw_gbps * 1e9) + COLLECTIVE_LATENCY_S


def gather_or_scatter_s(nbytes: float, ranks: int, busbw_gbps: float) -> float:
    """All-gather or reduce-scatter of a buffer of ``nbytes`` in total: (k-1)/k of it moves."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (busbw_gbps * 1e9) + COLLECTIVE_LATENCY_S


def alltoall_s(nbytes: float, ranks: tuple[int, ...], devices_per_node: int, intra_gbps: float,
               inter_gbps: float) -> float:
    """All-to-all of ``nbytes`` per rank over ``ranks``, an equal share to every member: the
    shares to members on other nodes leave over the device's network share, those to members on
    its node over the intra-node links, at once; the share a rank keeps does not move. The node
    with the fewest members of the group is the slowest (most of its shares leave it)."""
    k = len(ranks)
    if k == 1:
        return 0.0
    near = min(members_per_node(ranks, devices_per_node).values())  # members on the sparsest node
    inside = (near - 1) / k * nbytes / (intra_gbps * 1e9)
    outside = (k - near) / k * nbytes / (inter_gbps * 1e9)
    return max(inside, outside) + COLLECTIVE_LATENCY_S
