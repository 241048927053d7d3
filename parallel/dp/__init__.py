"""Data parallelism: gradient buffers and reducer, ZeRO-1 optimizer, gradient compression."""
from parallel.dp.buffers import Bucket, GradBuffer, ParamSlot
from parallel.dp.compression import CommStats, Compressor, Int8Compressor, TopKCompressor, ring_bytes
from parallel.dp.policy import CompressionPolicy, CompressorSpec, PolicyError
from parallel.dp.reducer import GradReducer, named_parameters
from parallel.dp.zero import DistributedOptimizer, MixedPrecisionOptimizer, ShardPiece

__all__ = [
    "Bucket", "GradBuffer", "ParamSlot", "CommStats", "Compressor", "Int8Compressor", "TopKCompressor",
    "ring_bytes", "CompressionPolicy", "CompressorSpec", "PolicyError", "GradReducer", "named_parameters",
    "DistributedOptimizer", "MixedPrecisionOptimizer", "ShardPiece",
]
