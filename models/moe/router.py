"""The top-k router: fp32 logits, stable top-k, and the score functions of Megatron-LM.

- ``softmax`` (default, Mixtral): top-k of the logits, then a softmax over the K chosen ones.
- ``softmax`` with ``pre_softmax``: softmax over all E experts first, then top-k of those
  probabilities, not renormalised.
- ``sigmoid``: top-k of sigmoid(logits), the chosen scores divided by their sum when K > 1.

With ``expert_bias`` (aux-loss-free balancing, DeepSeek-V3; sigmoid scores only) the experts are
chosen by the top-k of scores + bias, and their weights are the unbiased scores of the chosen ones;
the balancing losses count the top-k of the unbiased scores (models/moe/layer.py), as DeepSeek-V3
and Megatron-Core do. The bias is a buffer (E,) that stays fp32 whatever dtype the module is cast
to (``.to(torch.bfloat16)`` casts the router weight, not the bias: a bf16 bias would round off
the update's small steps), moved by ``models.moe.step_figures.update_expert_bias`` after each
optimizer step, never by the gradient.

Ties are broken by the lower expert index (a stable descending sort), so the choice depends only on
the token's values: every layout routes a token the same way. The router weight has the model's
dtype; the logits are computed in fp32 from it whatever the activations' dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallel.tensor_parallel.split_linear import linear_defer_w


@dataclass
class Routing:
    weights: torch.Tensor   # (T, K) fp32: each chosen expert's weight in the token's output
    experts: torch.Tensor   # (T, K) int64: the chosen experts, best first
    logits: torch.Tensor    # (T, E) fp32
    scores: torch.Tensor    # (T, E) fp32: per-expert probabilities the balancing losses use


def stable_topk(t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; equal values keep index order (the lower index wins). The
    indices come contiguous (the layer flattens them more than once)."""
    values, index = torch.sort(t, dim=-1, descending=True, stable=True)
    return values[..., :k], index[..., :k].contiguous()


class TopKRouter(nn.Module):
    """Replicated (E, h) weight, drawn from (seed, ``{name}.weight``) like every weight."""

    def __init__(self, hidden: int, num_experts: int, topk: int, init, name: str,
                 score_function: str = "softmax", pre_softmax: bool = False,
                 expert_bias: bool = False):
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.weight = nn.Parameter(init.full(f"{name}.weight", (num_experts, hidden)))
        self.weight_grad_store = None  # a zero-bubble schedule's W takes the weight gradient
        if expert_bias and score_function != "sigmoid":
            raise ValueError("--moe-router-enable-expert-bias works on sigmoid scores; add "
                             "--moe-router-score-function sigmoid")
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.bfloat16()``, ...: the expert bias stays fp32."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x: torch.Tensor) -> Routing:  # (T, h)
        store = self.weight_grad_store
        if store is not None and self.weight.dtype == torch.float32:  # W split off
            logits = linear_defer_w(x.float(), self.weight, None, store)  # (T, E) fp32
        else:
            logits = F.linear(x.float(), self.weight.float())  # (T, E) fp32
        k = self.topk
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            if self.expert_bias is None:
                values, experts = stable_topk(scores, k)                # (T, K)
            else:  # the bias chooses, the unbiased scores weigh
                _, experts = stable_topk(scores + self.expert_bias, k)  # (T, K)
                values = scores.gather(1, experts)
            weights = values / (values.sum(-1, keepdim=True) + 1e-20) if k > 1 else values
            balance = scores / (scores.sum(-1, keepdim=True) + 1e-20)  # (T, E)
            return Routing(weights, experts, logits, balance)
        probs = torch.softmax(logits, dim=-1)
        if self.pre_softmax:
            weights, experts = stable_topk(probs, k)
        else:
            values, experts = stable_topk(logits, k)
            weights = torch.softmax(values, dim=-1)
        return Routing(weights, experts, logits, probs)

    def extra_repr(self) -> str:
        pre = ", pre_softmax" if self.pre_softmax else ""
        return f"experts={self.num_experts}, topk={self.topk}, {self.score_function}{pre}"
