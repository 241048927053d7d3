"""Which tokens of a sequence each context-parallel rank holds: pure index arithmetic.

Ring attention (``--cp-comm-type p2p``) balances causal work: the sequence is cut into 2*cp equal
chunks and rank r holds chunks r and 2*cp-1-r, in that order. Early chunks attend to few keys and
late chunks to many, so every rank gets one of each and does the same work. Ulysses attention
(``a2a``) computes each head over the whole sequence, so it needs no balancing: rank r holds the
r-th contiguous 1/cp of the sequence, and the all-to-all lays the shards out in sequence order.

Worked example, 8 tokens, cp = 2 (chunks of 2 tokens)::

    load-balanced:  rank 0 -> chunks 0, 3 -> tokens [0 1 6 7]
                    rank 1 -> chunks 1, 2 -> tokens [2 3 4 5]
    contiguous:     rank 0 -> tokens [0 1 2 3],  rank 1 -> tokens [4 5 6 7]

With cp = 4 and 16 tokens, load-balanced rank 1 holds chunks 1 and 6: tokens [2 3 12 13]. The
shard keeps the order of the sequence (chunk r comes before chunk 2*cp-1-r), so causality inside a
shard is causality of its local indices.
"""
from __future__ import annotations

import torch

COMM_TYPES = ("p2p", "a2a")


def load_balanced(comm_type: str) -> bool:
    """Whether ``comm_type``'s shards are the load-balanced chunk pairs (ring) or contiguous."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {COMM_TYPES}, got {comm_type!r}")
    return comm_type == "p2p"


def check_shardable(seq_len: int, cp: int, balanced: bool) -> None:
    parts = 2 * cp if balanced else cp
    if seq_len % parts:
        why = "2*cp load-balanced chunks (ring attention)" if balanced else "cp contiguous shards"
        raise ValueError(f"sequence length {seq_len} does not split into {why}: use a sequence "
                         f"length that is a multiple of {parts}")


def chunk_ids(cp: int, rank: int, balanced: bool = True) -> tuple[int, ...]:
    """The chunks of a 2*cp split (balanced) or a cp split (contiguous) that ``rank`` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} outside 0..{cp - 1}")
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def shard_index(seq_len: int, cp: int, rank: int, balanced: bool = True) -> list[int]:
    """The sequence positions (increasing) that ``rank`` of ``cp`` holds."""
    if cp == 1:
        return list(range(seq_len))
    check_shardable(seq_len, cp, balanced)
    size = seq_len // (2 * cp if balanced else cp)
    return [c * size + i for c in chunk_ids(cp, rank, balanced) for i in range(size)]


def shard_positions(local_len: int, cp: int, rank: int, balanced: bool,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """(local_len,) int64: the global positions of a rank's ``local_len`` tokens (``shard_index``
    built on the device, without a host list)."""
    if cp == 1:
        return torch.arange(local_len, device=device)
    check_shardable(local_len * cp, cp, balanced)
    size = local_len // len(chunk_ids(cp, rank, balanced))
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunk_ids(cp, rank, balanced)])
