"""Load-balancing losses, defined so that every layout computes the same value.

Each function returns this rank's *share*: a number whose mean over the DP x CP ranks is the loss
of the step's micro-step, exactly as a micro-batch's mean token loss averages to the global one.
The reducer averages gradients over those ranks, so back-propagating the share gives the gradient
of the layout-independent loss.

- ``aux_loss`` (Switch / GShard, Megatron's global aux loss): coeff * E / K * sum_i f_i P_i with
  f_i the fraction of the micro-step's token assignments that chose expert i and P_i the mean
  probability of expert i, both over the tokens of *every* DP x CP rank's current micro-batch: the
  per-expert counts (and the token count) are summed over the DP x CP group before the product.
  The layouts agree when their micro-steps hold the same tokens: one micro-batch per step (the
  micro-step is then the global batch) in every layout.
- ``seq_aux_loss``: the same product per sequence, averaged over sequences; a micro-batch's share
  is the mean over its sequences (like the token loss), so it agrees for any split of the batch.
- ``z_loss``: coeff * mean over tokens of logsumexp(logits)^2 (a per-token mean).
"""
from __future__ import annotations

import torch

from parallel.comm import CommGroup


def aux_loss_share(scores: torch.Tensor, experts: torch.Tensor, coeff: float,
                   group: CommGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) scores, (T, K) chosen experts -> (this rank's share, global counts (E,) fp32)."""
    t, e = scores.shape
    k = experts.shape[1]
    counts = torch.bincount(experts.reshape(-1), minlength=e).to(torch.float32)
    both = torch.cat([counts, counts.new_tensor([t])])  # counts and tokens: one all-reduce
    group.all_reduce(both)
    counts_g, tokens_g = both[:e], both[e]
    share = (counts_g * scores.sum(0)).sum() * (coeff * e * group.size / k) / (tokens_g * tokens_g)
    return share, counts_g


def seq_aux_loss_share(scores: torch.Tensor, experts: torch.Tensor, batch: int,
                       coeff: float) -> torch.Tensor:
    """Per-sequence balancing loss, mean over this micro-batch's ``batch`` sequences."""
    t, e = scores.shape
    s, k = t // batch, experts.shape[1]
    counts = torch.zeros(batch, e, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(1, experts.reshape(batch, s * k),
                        torch.ones(batch, s * k, dtype=torch.float32, device=scores.device))
    f = counts / (s * k)                                  # (b, E)
    p = scores.view(batch, s, e).mean(1)                  # (b, E)
    return (f * p).sum(-1).mean() * (coeff * e)


def z_loss_share(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


class IdentityForwardAuxGradBackward(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward hands the auxiliary loss the gradient ``scale``, so
    that it trains whichever pipeline stage its layer sits on (the loss itself is never added to
    the output). ``scale`` is the factor the step's token loss is back-propagated with (1 / the
    micro-batches per step, times the loss scale)."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None
