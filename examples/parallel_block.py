"""An example user block: a "parallel" transformer block (GPT-J / PaLM style), where attention and
the MLP read the same normalised input and their outputs are added to the residual together.

Use it with ``python -m engine.train --block examples.parallel_block:ParallelResidualBlock``. It is
built from the engine's TP layers, so tensor, sequence and pipeline parallelism work unchanged.
"""
from torch import nn

from models.blocks import TransformerBlock
from models.layers import Dropout, Norm, ParallelAttention, ParallelMLP


class ParallelResidualBlock(TransformerBlock):
    position = "rope"  # rotary positions inside attention, no learned position table
    final_norm = "layernorm"
    tie_embeddings = True

    def __init__(self, cfg, layer_idx, ps, ctx):
        nn.Module.__init__(self)
        name = f"layers.{layer_idx}"
        self.ctx, self.full_recompute = ctx, ctx.recompute == "full"
        self.norm = Norm("layernorm", cfg.hidden_size, cfg.norm_eps, ctx.sequence_parallel)
        self.attn = ParallelAttention(cfg, ps, ctx, f"{name}.attn", bias=False, rope=True)
        self.mlp = ParallelMLP(cfg, ps, ctx, f"{name}.mlp", kind="gelu", bias=False)
        # the residual stream's dropout: a sequence shard under sequence parallelism (each TP rank
        # its own mask), else the same activation on every TP rank (the same mask)
        self.drop = Dropout(cfg.dropout, ctx, "hidden")

    def _forward(self, x, inputs=None):  # (b, s[/tp], h); inputs: positions / packed documents
        y = self.norm(x)
        return x + self.drop(self.attn(y, inputs) + self.mlp(y))
