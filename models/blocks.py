"""The built-in transformer blocks and the interface a user's block implements.

A block is an ``nn.Module`` constructed as ``Block(cfg, layer_idx, ps, ctx)`` where ``layer_idx`` is
the GLOBAL layer index (use it in parameter names given to the initializer, so initialization does
not depend on the layout), and called as ``block(x, inputs)`` with x of shape (b, s, h), or
(b, s/tp, h) under sequence parallelism, returning the same shape. ``inputs`` is the micro-batch's
``models.batch.AttentionInputs`` (per-token positions, packed documents) or None; hand it to
``ParallelAttention``. A block whose forward takes only x is called as ``block(x)`` and works
wherever no per-token metadata is needed (not with packed documents, see
``takes_attention_inputs``). Class attributes choose the model around the blocks: ``position``
("learned" or "rope"), ``final_norm`` ("layernorm" or "rmsnorm") and ``tie_embeddings``; and
``handles_recompute`` (``recomputes_itself``). Build the block from the TP layers in models.layers /
parallel.tensor_parallel to get tensor and sequence parallelism; the contract (position-wise
outside ParallelAttention, parameter marks, the initializer) is docs/blocks.md.
"""
from __future__ import annotations

import inspect

from torch import nn
from torch.utils.checkpoint import checkpoint

from models.config import GPTConfig
from models.layers import Dropout, LayerContext, Norm, ParallelAttention
from models.moe.layer import build_mlp
from parallel.grid.state import ParallelState


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
        self.ctx, self.full_recompute = ctx, ctx.recompute == "full"
        self.norm1 = Norm(self.norm_kind, cfg.hidden_size, cfg.norm_eps, sp, ctx.kernel_paths)
        self.attn = ParallelAttention(cfg, ps, ctx, f"{name}.attn", bias=self.bias, rope=self.rope)
        self.norm2 = Norm(self.norm_kind, cfg.hidden_size, cfg.norm_eps, sp, ctx.kernel_paths)
        # the dense MLP, or a mixture of experts where --moe-layer-freq puts one (models/moe)
        self.mlp = build_mlp(cfg, layer_idx, ps, ctx, f"{name}.mlp", kind=self.mlp_kind, bias=self.bias)
        self.drop = Dropout(cfg.dropout, ctx, "hidden")

    def _forward(self, x, inputs=None):  # (b, s[/tp], h)
        x = x + self.drop(self.attn(self.norm1(x), inputs))
        return x + self.drop(self.mlp(self.norm2(x)))

    def forward(self, x, inputs=None):
        args = (x,) if inputs is None else (x, inputs)  # a subclass's _forward may take x alone
        if self.full_recompute and self.training and x.requires_grad:
            ctx = getattr(self, "ctx", None)  # a subclass may build itself without TransformerBlock's init
            if ctx is None:
                return checkpoint(self._forward, *args, use_reentrant=False)
            return ctx.checkpoint(self._forward, *args)
        return self._forward(*args)


class GPT2Block(TransformerBlock):
    """GPT-2: LayerNorm, learned positions, GELU MLP, biases, tied input/output embeddings."""


class LlamaBlock(TransformerBlock):
    """Llama: RMSNorm, rotary positions, SwiGLU MLP, no biases, untied embeddings."""
    position, final_norm, tie_embeddings = "rope", "rmsnorm", False
    norm_kind, mlp_kind, bias, rope = "rmsnorm", "swiglu", False, True


def called_forward(cls: type):
    """The function a block's call runs with (x[, inputs]): a TransformerBlock subclass that keeps
    TransformerBlock.forward runs its ``_forward``; any other block (a subclass that overrides
    ``forward`` included) its ``forward``."""
    if issubclass(cls, TransformerBlock) and cls.forward is TransformerBlock.forward:
        return cls._forward
    return cls.forward


def takes_attention_inputs(cls: type) -> bool:
    """Whether a block accepts the ``AttentionInputs`` as a second positional argument (see
    ``called_forward``)."""
    params = list(inspect.signature(called_forward(cls)).parameters.values())[1:]  # after self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params) or \
        sum(p.kind in kinds for p in params) >= 2


def recomputes_itself(cls: type) -> bool:
    """Whether a block implements ``--recompute full`` itself: a TransformerBlock subclass that
    keeps TransformerBlock.forward (which checkpoints ``_forward``), or a class that declares
    ``handles_recompute = True`` (and calls ``ctx.checkpoint`` when ``ctx.recompute == "full"``).
    The chunk checkpoints every other block whole (models/gpt.py)."""
    declared = getattr(cls, "handles_recompute", None)
    if declared is not None:
        return bool(declared)
    return issubclass(cls, TransformerBlock) and cls.forward is TransformerBlock.forward
