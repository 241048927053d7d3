"""User blocks for tests (``--block tests.helpers.blocks:Name``)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from models.blocks import TransformerBlock
from models.layers import Norm, ParallelAttention, ParallelMLP


class DirectNormBlock(TransformerBlock):
    """A user's GPT-2 block that reads its children's parameters itself: the norms' weight and
    bias go to ``F.layer_norm`` directly, never through the ``Norm`` modules' forward (so a wait
    in the norms' own forward pre-hooks would never run)."""

    def _norm(self, norm, x):  # (b, s[/tp], h)
        return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)

    def _forward(self, x, inputs=None):
        x = x + self.drop(self.attn(self._norm(self.norm1, x), inputs))
        return x + self.drop(self.mlp(self._norm(self.norm2, x)))


class XOnly(nn.Module):
    """A plain ``nn.Module`` GPT-2 block whose forward takes x alone (learned positions); it does
    nothing for ``--recompute full`` itself."""
    position, final_norm, tie_embeddings = "learned", "layernorm", True

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__()
        name, sp = f"layers.{layer_idx}", ctx.sequence_parallel
        self.norm1 = Norm("layernorm", cfg.hidden_size, cfg.norm_eps, sp, ctx.kernel_paths)
        self.attn = ParallelAttention(cfg, ps, ctx, f"{name}.attn", bias=True, rope=False)
        self.norm2 = Norm("layernorm", cfg.hidden_size, cfg.norm_eps, sp, ctx.kernel_paths)
        self.mlp = ParallelMLP(cfg, ps, ctx, f"{name}.mlp", kind="gelu", bias=True)

    def forward(self, x):  # (b, s[/tp], h)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Hybrid(TransformerBlock):
    """Attention on even layers only; odd layers are the MLP alone (a structure by layer)."""

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__(cfg, layer_idx, ps, ctx)
        self.has_attn = layer_idx % 2 == 0
        if not self.has_attn:
            del self.attn, self.norm1

    def _forward(self, x, inputs=None):  # (b, s[/tp], h)
        if self.has_attn:
            x = x + self.drop(self.attn(self.norm1(x), inputs))
        return x + self.drop(self.mlp(self.norm2(x)))


class ShardedScale(TransformerBlock):
    """A per-unit scale on the MLP's hidden units, split over TP like them (f/tp per rank): drawn
    by the initializer at its logical (f,) shape and sliced with ``shard_dim=0``."""

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__(cfg, layer_idx, ps, ctx)
        self.hscale = ctx.init.param(f"layers.{layer_idx}.hscale", (cfg.ffn_hidden_size,), "ones",
                                     shard_dim=0, rank=ps.tp_rank, size=ps.tp_size)  # (f/tp,)

    def _forward(self, x, inputs=None):  # (b, s[/tp], h)
        x = x + self.drop(self.attn(self.norm1(x), inputs))
        hidden = F.gelu(self.mlp.fc1(self.norm2(x)), approximate="tanh") * self.hscale  # (b, s, f/tp)
        return x + self.drop(self.mlp.fc2(hidden))


class Shrink(TransformerBlock):
    """A broken block: drops the last position, so its output is not its input's shape."""

    def _forward(self, x, inputs=None):
        return super()._forward(x, inputs)[:, :-1]



class BothWaysNormBlock(TransformerBlock):
    """A user's GPT-2 block that reads its second norm's parameters both ways: through the
    ``Norm`` module (whose weight gradient a zero-bubble schedule leaves to W) and directly in
    ``F.layer_norm`` (whose gradient autograd computes in B): one parameter, two accumulations per
    micro-batch, counted once by the DP reducer."""

    def _forward(self, x, inputs=None):
        n = self.norm2
        x = x + self.drop(self.attn(self.norm1(x), inputs))
        side = F.layer_norm(x, x.shape[-1:], n.weight, n.bias, n.eps)          # B
        return x + self.drop(self.mlp(n(x))) + 0.5 * side                      # W (the module)
