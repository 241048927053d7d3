"""Autograd Functions that must run outside a torch.compile graph (their state is Python: ring
handles, W closures) go through ``parallel.grads.weight_grad.apply_eager``: Dynamo leaves them out
of the traced graph. A ``torch.compiler.disable`` on the Function class does not: Dynamo traces its
``apply`` into the graph as ``autograd_function_apply`` (the defect this guards against)."""
from __future__ import annotations

import torch

from parallel.tensor_parallel.overlap import _apply


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@torch.compiler.disable
class DisabledTwice(Twice):
    pass


def _graph_code(fn) -> str:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(torch.ones(3, requires_grad=True))
    return "\n".join(g.code for g in explained.graphs)


def test_apply_eager_keeps_the_function_out_of_the_graph():
    code = _graph_code(lambda x: _apply(Twice, x) + 1)
    assert "autograd_function_apply" not in code and "add" in code
    assert "autograd_function_apply" in _graph_code(lambda x: DisabledTwice.apply(x) + 1)
    x = torch.ones(3, requires_grad=True)
    torch.compile(lambda t: _apply(Twice, t) + 1, backend="eager")(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
