"""Context parallelism: the sequence of every sample split over the CP group.

- sharding.py: which tokens each rank holds (load-balanced chunk pairs for the ring, contiguous
  shards for Ulysses), pure arithmetic;
- ring.py: ring attention, K/V blocks around the CP ring with log-sum-exp merging;
- all_to_all.py: Ulysses' sequence <-> head all-to-all;
- attention.py: ``context_parallel_attention``, the entry point of the model's attention layer.

Everything outside attention runs on the shard unchanged; gradients of replicated parameters are
reduced over DP x CP by the DP reducer.
"""
import torch

from parallel.context_parallel.all_to_all import head_to_seq, seq_to_head
from parallel.context_parallel.attention import (context_parallel_attention, ulysses_attention,
                                                 ulysses_kv_repeat)
from parallel.context_parallel.ring import ring_attention
from parallel.context_parallel.sharding import (COMM_TYPES, check_shardable, chunk_ids,
                                                load_balanced, shard_index, shard_positions)


def init_ring(ps) -> None:
    """Create the CP group's communicator with one collective on every rank of the group (NCCL/HCCL
    create communicators lazily, and a first batch_isend_irecv not joined by all is undefined
    there). A no-op without context parallelism."""
    if ps.cp_size > 1:
        ps.cp_group.all_reduce(torch.zeros(1, device=ps.device))


__all__ = ["COMM_TYPES", "check_shardable", "chunk_ids", "context_parallel_attention", "head_to_seq",
           "init_ring", "load_balanced", "ring_attention", "seq_to_head", "shard_index",
           "shard_positions", "ulysses_attention", "ulysses_kv_repeat"]
