from models.blocks import GPT2Block, LlamaBlock, TransformerBlock
from models.config import GPTConfig
from models.batch import AttentionInputs
from models.gpt import GPTChunk, build_chunks
from models.layers import Dropout, LayerContext, Norm, ParallelAttention, ParallelMLP
from models.registry import BlockRegistry, default_registry

__all__ = ["AttentionInputs", "GPTConfig", "GPTChunk", "build_chunks", "Dropout", "LayerContext", "Norm",
           "ParallelAttention", "ParallelMLP", "TransformerBlock", "GPT2Block", "LlamaBlock",
           "BlockRegistry", "default_registry"]
