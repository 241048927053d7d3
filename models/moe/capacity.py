"""Expert capacity: which assignments a capacity factor drops, and the padded layout.

With ``--moe-expert-capacity-factor F`` each expert of a layer takes at most

    capacity = ceil(F * T * K / E)

of the T K assignments of the T tokens one rank routes in one forward (its micro-batch's b s
tokens, as in Megatron-LM: the capacity is per rank and per micro-batch). The assignments of an
expert are ranked by their router weight (the weight the token's output uses), highest first,
equal weights by the lower token index (a stable sort), and those ranked ``capacity`` or later
are dropped: the token's output leaves that expert out (its other experts and the shared expert
still count; the remaining weights are not renormalised). The choice is made before the dispatch,
on each rank's own tokens, so it depends on which tokens a rank's micro-batch holds: layouts with
the same micro-batch size hold the same sequences per micro-batch and drop the same assignments
whatever their tp, dp and ep; a different micro-batch size (or a split of the sequence) changes T
and the ranking pool.

``--moe-pad-expert-input-to-capacity`` gives every expert exactly ``capacity`` rows (the kept
assignments, then padding rows that weigh 0), so every shape and split size is known in advance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """ceil(factor * num_tokens * topk / num_experts), at least 1."""
    if not math.isfinite(factor):
        raise ValueError(f"--moe-expert-capacity-factor {factor} must be a finite number > 0 "
                         f"(leave it unset for dropless routing)")
    if not factor > 0:
        raise ValueError(f"--moe-expert-capacity-factor {factor} must be > 0 (leave it unset for "
                         f"dropless routing)")
    return max(1, math.ceil(factor * num_tokens * topk / num_experts - 1e-9))


@dataclass
class CapacityChoice:
    """One forward's capacity decision: ``keep`` (T, K) bool per assignment, ``order`` (T, E) the
    tokens of each expert column by rank (routed ones first), ``key`` (T, E) the ranking key
    (the router weight where routed, -1 elsewhere), ``capacity``."""
    keep: torch.Tensor
    order: torch.Tensor
    key: torch.Tensor
    capacity: int

    @property
    def dropped(self) -> torch.Tensor:
        """The number of dropped assignments (0-d int64, on the device)."""
        return (~self.keep).sum()


def choose(weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
           capacity: int) -> CapacityChoice:
    """The assignments each expert keeps: its ``capacity`` highest router weights, ties to the
    lower token index. ``weights``, ``experts``: (T, K)."""
    t, k = experts.shape
    key = torch.full((t, num_experts), -1.0, dtype=torch.float32, device=weights.device)
    key.scatter_(1, experts, weights.detach().float())
    order = torch.argsort(key, dim=0, descending=True, stable=True)  # (T, E) tokens by rank
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(t, device=order.device).unsqueeze(1).expand(t, num_experts))
    keep = rank.gather(1, experts) < capacity
    return CapacityChoice(keep, order, key, capacity)


def padded_rows(choice: CapacityChoice, experts: torch.Tensor):
    """The padded layout: for each expert its ``capacity`` rows (kept assignments in rank order,
    then padding) as (token, flat assignment index, mask) vectors of E C entries."""
    t, k = experts.shape
    e, c = choice.key.shape[1], choice.capacity
    take = min(c, t)
    tokens = choice.order[:take].t()                                   # (E, take)
    routed = choice.key.gather(0, choice.order[:take]).t() >= 0        # (E, take)
    position = torch.zeros(t, e, dtype=torch.long, device=experts.device)
    position.scatter_(1, experts, torch.arange(k, device=experts.device).expand(t, k))
    slot = position.gather(0, choice.order[:take]).t()                 # (E, take): k of (token, e)
    flat = tokens * k + slot
    if take < c:  # more room than tokens: padding rows of token 0
        pad = tokens.new_zeros((e, c - take))
        tokens, flat = torch.cat([tokens, pad], 1), torch.cat([flat, pad], 1)
        routed = torch.cat([routed, pad.bool()], 1)
    mask = routed.float()
    flat = torch.where(routed, flat, torch.zeros_like(flat))  # padding weighs 0 whatever it gathers
    return tokens.reshape(-1), flat.reshape(-1), mask.reshape(-1)
