"""Ring collectives' times at a bus bandwidth (nccl-tests' busbw convention), one latency each.

>>> round(allreduce_s(1e9, 8, 100.0), 6), round(gather_or_scatter_s(1e9, 8, 100.0), 6)
(0.01752, 0.00877)
"""
from __future__ import annotations

from engine.plan.model import COLLECTIVE_LATENCY_S


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
