"""Data parallelism: gradient buffers and reducer, ZeRO-1 optimizer, gradient compression."""
from parallel.dp.buffers import Bucket, GradBuffer, ParamSlot
from parallel.dp.compression import Compressor, Int8Compressor, TopKCompressor
from parallel.dp.policy import CompressionPolicy, CompressorSpec, PolicyError
from parallel.dp.reducer import GradReducer, named_parameters
from parallel.dp.zero import DistributedOptimizer, MixedPrecisionOptimizer, ShardPiece

__all__ = [
    "Bucket", "GradBuffer", "ParamSlot", "Compressor", "Int8Compressor", "TopKCompressor",
    "CompressionPolicy", "CompressorSpec", "PolicyError", "GradReducer", "named_parameters",
    "DistributedOptimizer", "MixedPrecisionOptimizer", "ShardPiece",
]
