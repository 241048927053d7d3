"""User blocks for tests (``--block tests.helpers.blocks:Name``)."""
from __future__ import annotations

import torch.nn.functional as F

from models.blocks import TransformerBlock


class DirectNormBlock(TransformerBlock):
    """A user's GPT-2 block that reads its children's parameters itself: the norms' weight and
    bias go to ``F.layer_norm`` directly, never through the ``Norm`` modules' forward (so a wait
    in the norms' own forward pre-hooks would never run)."""

    def _norm(self, norm, x):  # (b, s[/tp], h)
        return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)

    def _forward(self, x, inputs=None):
        x = x + self.drop(self.attn(self._norm(self.norm1, x), inputs))
        return x + self.drop(self.mlp(self._norm(self.norm2, x)))
