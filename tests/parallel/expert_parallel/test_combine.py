"""The combine of an MoE layer in one autograd node (parallel/expert_parallel/permute.py
``unpermute_tokens``): each token's rows gathered, weighed by its router weights and summed. Its
output and the gradients of the rows and the weights equal autograd's of the plain expression,
dropless (the rows a permutation of the assignments: the backward gathers) and with a capacity
(dropped copies: the backward adds), fp32 and bf16 rows under fp32 weights; the passenger loss gets
exactly the given scale as its gradient, and none without one."""
from __future__ import annotations

import pytest
import torch

from parallel.expert_parallel import permute_tokens, unpermute_tokens

E, K, T, H = 4, 2, 6, 8


def _case(keep: bool, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    mask = torch.rand(T, K, generator=gen) > 0.3 if keep else None
    _, perm = permute_tokens(x, experts, E, keep=mask)
    rows = torch.randn(perm.rows, H, generator=gen).to(dtype)
    return rows, weights, perm


def _plain(rows, weights, perm):
    """The expression the Function replaces, under autograd."""
    t, k = perm.num_tokens, perm.topk
    w = weights if perm.keep is None else weights * perm.keep.view(t, k).to(weights.dtype)
    gathered = rows.index_select(0, perm.slots).view(t, k, rows.shape[1])
    return (gathered * w.to(rows.dtype).unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_equals_the_plain_expression(keep, dtype):
    rows, weights, perm = _case(keep, dtype)
    grad = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (unpermute_tokens, _plain):
        r, w = rows.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(r, w, perm)
        out.backward(grad)
        results.append((out.detach(), r.grad, w.grad))
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_the_passenger_loss_gets_the_scale():
    rows, weights, perm = _case(False, torch.float32)
    loss = torch.tensor(0.25, requires_grad=True)
    unpermute_tokens(rows.requires_grad_(), weights, perm, loss * 2, 0.375).sum().backward()
    assert loss.grad.item() == 0.75                      # d(2 loss) times the scale
    rows.grad = None
    unpermute_tokens(rows, weights, perm).sum().backward()
    assert rows.grad is not None and loss.grad.item() == 0.75  # no passenger: untouched
