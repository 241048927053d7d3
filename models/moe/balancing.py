"""Load-balancing losses, defined so that every layout computes the same value.

Each function returns this rank's *share*: a number whose mean over the DP x CP ranks, once the
shares of a TP group under sequence parallelism are summed, is the loss of the step's micro-step,
exactly as a micro-batch's mean token loss averages to the global one. The shares follow the
gradient's path: the reducer averages gradients over the DP x CP ranks, and under sequence
parallelism the router's and the experts' gradients are summed over the TP ranks (each saw its own
tokens, parallel/grads/main_grad.py ``sync_sequence_parallel_grads``), so back-propagating the share
gives the gradient of the layout-independent loss in every layout.

- ``aux_loss`` (Switch / GShard; global, as Megatron's ``global_aux_loss`` without its running
  average over micro-batches, not Megatron's per-micro-batch ``aux_loss``): coeff * E / K *
  sum_i f_i P_i with f_i the fraction of the micro-step's token assignments that chose expert i
  (with the expert bias: of the unbiased top-k) and P_i the mean probability of expert i, both
  over the tokens of *every* DP x CP rank's current micro-batch
  (and, under sequence parallelism, every TP rank's shard of it): the per-expert counts and the
  token count are summed over those ranks before the product. The layouts agree when their
  micro-steps hold the same tokens: one micro-batch per step (the micro-step is then the global
  batch) in every layout.
- ``seq_aux_loss``: the same product per sequence, averaged over sequences; a micro-batch's share
  is the mean over its sequences (like the token loss), so it agrees for any split of the batch.
  A sequence split over ranks (TP under sequence parallelism, CP) has its per-expert counts summed
  over them, and each rank adds its tokens' part of the mean probability.
- ``z_loss``: coeff * mean over tokens of logsumexp(logits)^2 (a per-token mean); a TP rank under
  sequence parallelism holds 1/tp of its micro-batch's tokens and takes 1/tp of the mean.
"""
from __future__ import annotations

import torch

from parallel.runtime.comm import CommGroup


def aux_loss_share(scores: torch.Tensor, counts: torch.Tensor, topk: int, coeff: float,
                   group: CommGroup, token_groups: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) scores, (E,) assignments per expert of this rank's tokens (the layer's one count,
    ``parallel.expert_parallel.count_per_expert``) -> (this rank's share, global counts (E,) fp32).

    ``group``: the ranks whose shares are averaged (DP x CP); ``token_groups``: further groups
    whose ranks hold other tokens of the same micro-batch and whose shares are summed (the TP
    group under sequence parallelism)."""
    t, e = scores.shape
    counts = counts.to(torch.float32)
    if group.size == 1 and all(g.size == 1 for g in token_groups):  # nothing to sum over
        return (counts * scores.sum(0)).sum() * (coeff * e / topk / (t * t)), counts
    # counts and tokens: one all-reduce (the token count made on the device: no host data)
    both = torch.cat([counts,
                      torch.full((1,), float(t), dtype=torch.float32, device=scores.device)])
    for g in (group, *token_groups):
        g.all_reduce(both)
    counts_g, tokens_g = both[:e], both[e]
    share = (counts_g * scores.sum(0)).sum() * (coeff * e * group.size / topk) / (tokens_g * tokens_g)
    return share, counts_g


def seq_aux_loss_share(scores: torch.Tensor, experts: torch.Tensor, batch: int, coeff: float,
                       seq_groups: tuple = (), averaged: int = 1) -> torch.Tensor:
    """Per-sequence balancing loss, mean over this micro-batch's ``batch`` sequences.

    ``seq_groups``: the groups whose ranks hold the other pieces of these sequences (TP under
    sequence parallelism, CP): the per-sequence counts are summed over them, and this rank's
    share is its tokens' part of the sum over a sequence's pieces; ``averaged``: how many of those
    ranks the gradient path averages over rather than sums (the CP size: the reducer averages over
    DP x CP), which the share is multiplied by."""
    t, e = scores.shape
    s, k = t // batch, experts.shape[1]
    counts = torch.zeros(batch, e, dtype=torch.float32, device=scores.device)
    counts.scatter_add_(1, experts.reshape(batch, s * k),
                        torch.ones(batch, s * k, dtype=torch.float32, device=scores.device))
    full = s                                               # the whole sequence's tokens
    for g in seq_groups:
        g.all_reduce(counts)
        full *= g.size
    f = counts / (full * k)                               # (b, E)
    p = scores.view(batch, s, e).sum(1) / full            # (b, E): this rank's part of the mean
    return (f * p).sum(-1).mean() * (coeff * e * averaged)


def z_loss_share(logits: torch.Tensor, coeff: float, split: int = 1) -> torch.Tensor:
    """``split``: the ranks summing their shares over one micro-batch's tokens (tp under
    sequence parallelism)."""
    return torch.logsumexp(logits, dim=-1).square().mean() * (coeff / split)
