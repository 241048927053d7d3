"""Cross-entropy over vocabulary-parallel logits without gathering the full logits.

Each TP rank holds logits for a contiguous vocabulary slice. The max and the sum of exponentials
are reduced over TP (numerically stable log-sum-exp), the target logit is picked by the rank that
owns it, and logits of padding entries (index >= vocab_size) are excluded, so padding changes
neither the loss nor the gradients. Without TP, torch's fused ``cross_entropy`` does the same. A
label of ``IGNORE_INDEX`` (-100, torch's ``ignore_index``) gets loss 0 and no gradient on every
layout (the engine's own batches mask with ``loss_mask`` instead).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.runtime.comm import group_size

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size):
        # logits (b, s, v/tp) any float dtype; target (b, s) global token ids
        logits = logits.float()
        per_rank = logits.shape[-1]
        ids = torch.arange(vocab_start, vocab_start + per_rank, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
        local_max = logits.max(dim=-1).values
        if group_size(group) > 1:
            group.all_reduce(local_max, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)  # (b, s, v/tp)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < per_rank)
        safe_t = local_t.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        if group_size(group) > 1:
            both = torch.stack([sum_exp, target_logit])
            group.all_reduce(both)
            sum_exp, target_logit = both[0], both[1]
        kept = target != IGNORE_INDEX                                  # (b, s)
        loss = (sum_exp.log() - target_logit).masked_fill(~kept, 0.0)  # (b, s)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe_t, mine, kept)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_t, mine, kept = ctx.saved_tensors
        grad = softmax.clone()
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        flat[rows, safe_t.view(-1)] -= mine.view(-1).to(grad.dtype)
        grad.mul_((grad_loss * kept).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Per-token loss (b, s) in fp32; the gradient flows back in fp32 to the logits' dtype.

    With the vocabulary on one rank (no TP) nothing is reduced: the padding columns are sliced
    off and torch's own fused ``cross_entropy`` computes the same log-sum-exp in fewer kernels
    (the padding's gradient is the slice's zeros)."""
    if group_size(group) == 1:
        real = logits[..., : vocab_size - vocab_start].float()  # (b, s, V): no padding columns
        # the ids autograd keeps are a copy of this micro-batch's (as the vocab-parallel path's
        # are), not a view pinning the storage of the whole batch the labels were cut from
        ids = target.flatten().clone()
        return F.cross_entropy(real.flatten(0, -2), ids, reduction="none",
                               ignore_index=IGNORE_INDEX).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size)
