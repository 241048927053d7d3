"""The built-in transformer blocks and the interface a user's block implements.

A block is an ``nn.Module`` constructed as ``Block(cfg, layer_idx, ps, ctx)`` where ``layer_idx`` is
the GLOBAL layer index (use it in parameter names given to the initializer, so initialization does
not depend on the layout), and called as ``block(x)`` with x of shape (b, s, h), or (b, s/tp, h)
under sequence parallelism, returning the same shape. Class attributes choose the model around the
blocks: ``position`` ("learned" or "rope"), ``final_norm`` ("layernorm" or "rmsnorm") and
``tie_embeddings``. Build the block from the TP layers in models.layers / parallel.tensor_parallel
to get tensor and sequence parallelism for free.
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from models.config import GPTConfig
from models.layers import LayerContext, Norm, ParallelAttention, ParallelMLP
from parallel.state import ParallelState


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). Subclasses pick the parts."""
    position = "learned"
    final_norm = "layernorm"
    tie_embeddings = True
    norm_kind, mlp_kind, bias, rope = "layernorm", "gelu", True, False

    def __init__(self, cfg: GPTConfig, layer_idx: int, ps: ParallelState, ctx: LayerContext):
        super().__init__()
        name = f"layers.{layer_idx}"
        sp = ctx.sequence_parallel
        self.full_recompute = ctx.recompute == "full"
        self.norm1 = Norm(self.norm_kind, cfg.hidden_size, cfg.norm_eps, sp)
        self.attn = ParallelAttention(cfg, ps, ctx, f"{name}.attn", bias=self.bias, rope=self.rope)
        self.norm2 = Norm(self.norm_kind, cfg.hidden_size, cfg.norm_eps, sp)
        self.mlp = ParallelMLP(cfg, ps, ctx, f"{name}.mlp", kind=self.mlp_kind, bias=self.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def _forward(self, x):  # (b, s[/tp], h)
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))

    def forward(self, x):
        if self.full_recompute and self.training and x.requires_grad:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT2Block(TransformerBlock):
    """GPT-2: LayerNorm, learned positions, GELU MLP, biases, tied input/output embeddings."""


class LlamaBlock(TransformerBlock):
    """Llama: RMSNorm, rotary positions, SwiGLU MLP, no biases, untied embeddings."""
    position, final_norm, tie_embeddings = "rope", "rmsnorm", False
    norm_kind, mlp_kind, bias, rope = "rmsnorm", "swiglu", False, True
