"""Data parallelism: gradient buffers and reducer (reducer.py; its compressed side,
reducer_compressed.py), the ZeRO-1/2 optimizer with overlapped parameter gather, ZeRO-3's parameter
shards (zero3.py) and the optimizer's host offload (offload.py), gradient compression with error
feedback and frozen-variance Adam, memory accounting."""
from parallel.dp.buffers import Bucket, GradBuffer, ParamSlot
from parallel.dp.compression import Compressor, Int8Compressor, TopKCompressor
from parallel.dp.dgc import MomentumTopKCompressor
from parallel.dp.memory import memory_bytes
from parallel.dp.onebit import OneBitCompressor
from parallel.dp.policy import CompressionPolicy, CompressorSpec, PolicyError
from parallel.dp.reducer import GradReducer, named_parameters
from parallel.dp.variance import LocalVariance, LogQuantizer
from parallel.dp.mixed_precision import MixedPrecisionOptimizer
from parallel.dp.zero import DistributedOptimizer, ShardPiece

__all__ = [
    "Bucket", "GradBuffer", "ParamSlot", "Compressor", "Int8Compressor", "TopKCompressor",
    "CompressionPolicy", "CompressorSpec", "PolicyError", "GradReducer", "named_parameters",
    "DistributedOptimizer", "MixedPrecisionOptimizer", "ShardPiece", "memory_bytes",
    "LocalVariance", "LogQuantizer", "OneBitCompressor", "MomentumTopKCompressor",
]
