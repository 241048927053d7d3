from parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor_parallel.init import Initializer, shard
from parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, vocab_parallel_weight,
                                             VocabParallelEmbedding, divide, padded_vocab_size)
from parallel.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence, gather_from_tp,
                                               reduce_from_tp, reduce_scatter_to_sequence,
                                               scatter_to_sequence, scatter_to_tp)
from parallel.tensor_parallel.overlap import (ring_gather_linear, ring_linear_reduce_scatter,
                                              set_tp_comm_overlap)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "Initializer",
           "shard", "divide", "vocab_parallel_weight", "padded_vocab_size", "vocab_parallel_cross_entropy", "copy_to_tp",
           "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "gather_from_sequence",
           "reduce_scatter_to_sequence", "scatter_to_sequence", "ring_gather_linear",
           "ring_linear_reduce_scatter", "set_tp_comm_overlap"]
