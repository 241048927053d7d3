"""Linear and embedding layers' autograd Functions with the weight gradient split off (the W of a
zero-bubble schedule, parallel/weight_grad.py), one per communication pattern:

- ``_LinearDeferW`` (no communication): y = x W^T + b. B: dx = dy W; W: dW = dy^T x, db = sum dy.
  Column-parallel layers without sequence parallelism put ``copy_to_tp`` in front of it,
  row-parallel layers their reduction behind it, the output layer uses it as is.
- ``_SeqGatherLinearReduceScatter`` (column-parallel under sequence parallelism, one or several
  weights reading the same input): forward all-gathers the sequence shard (b, s/tp, h) -> (b, s,
  h) and applies each weight; it saves only the shard (Megatron-LM's
  LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel), so backward
  all-gathers it again for the weight gradients, and reduce-scatters the input gradient. The
  second all-gather is issued asynchronously before the input-gradient GEMM and waited for after
  it when the weight gradients are computed in B; when they wait for W, W gathers the shard then
  (a TP collective: every TP rank of the stage runs the same W actions in the same order).
- ``_EmbeddingDeferW``: the lookup has no input gradient; B does nothing, W scatters the rows'
  gradients into the weight (``embedding_dense_backward``, F.embedding's own backward).

Each applies its weight gradient through ``accumulate`` / ``accumulate_matmul``: straight into
``main_grad`` when deferred, returned to autograd otherwise. Parameters are kept on ``ctx`` as the
Parameter objects (only activations go through ``save_for_backward``): under activation
checkpointing a saved tensor comes back in backward as a recomputed alias, and W must accumulate
into the parameter itself. Under ``torch.compile`` these calls run
outside the compiled graph when a store is attached (``torch.compiler.disable``): the W closures
are Python side effects of backward that a traced backward graph cannot hold.
"""
from __future__ import annotations

import torch

from parallel.tensor_parallel.mappings import _gather, _reduce_scatter
from parallel.weight_grad import WeightGradStore, accumulate, accumulate_matmul, apply_split


def _flat(t: torch.Tensor) -> torch.Tensor:  # (..., n) -> (N, n)
    return t.reshape(-1, t.shape[-1])


def _weight_grads(weight, bias, grad: torch.Tensor, x: torch.Tensor) -> None:
    """Accumulate dW = dy^T x and db = sum dy (any leading dims) into the parameters."""
    accumulate_matmul(weight, _flat(grad).t(), _flat(x))
    if bias is not None:
        accumulate(bias, _flat(grad).sum(dim=0))


class _LinearDeferW(torch.autograd.Function):
    """y = x W^T + b, weight gradients in W when a store is capturing (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        # the parameters themselves, not saved tensors: under activation checkpointing a saved
        # tensor comes back as a recomputed alias, and W must accumulate into the Parameter
        ctx.store, ctx.weight, ctx.bias = store, weight, bias
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        params = (weight,) if bias is None else (weight, bias)
        if ctx.store is not None and ctx.store.defer(lambda: _weight_grads(weight, bias, grad, x),
                                                     params, (grad, x)):
            return grad_x, None, None, None
        gw = _flat(grad).t().matmul(_flat(x))
        gb = _flat(grad).sum(dim=0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_x, gw, gb, None


class _SeqGatherLinearReduceScatter(torch.autograd.Function):
    """Column-parallel linear(s) on a sequence shard: forward all-gather + GEMMs, backward GEMMs +
    reduce-scatter, the input re-gathered for the weight gradients (module docstring).
    ``params`` is (weight_0, bias_0, weight_1, bias_1, ...); a bias may be None."""

    @staticmethod
    def forward(ctx, shard, group, store, *params):
        full = _gather(shard, 1, group)  # (b, s, h)
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(shard)
        ctx.group, ctx.store, ctx.weights, ctx.biases = group, store, weights, biases
        outs = tuple(torch.nn.functional.linear(full, w, b) for w, b in zip(weights, biases))
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        (shard,) = ctx.saved_tensors
        group, weights, biases = ctx.group, ctx.weights, ctx.biases
        grads = list(grads)
        deferred = ctx.store is not None and ctx.store.capturing
        overlap = not torch.compiler.is_compiling()  # a traced backward keeps no async handles
        later = None if deferred else _gather(shard, 1, group, async_op=overlap)
        if later is not None and not overlap:
            gathered = later
            later = (lambda: gathered, None)
        grad_full = None
        for g, w in zip(grads, weights):
            if g is not None:
                part = g.matmul(w)  # (b, s, h)
                grad_full = part if grad_full is None else grad_full + part
        grad_shard = _reduce_scatter(grad_full, 1, group) if grad_full is not None else None
        params = [p for w, b in zip(weights, biases) for p in (w, b) if p is not None]

        def weight_grads(full: torch.Tensor) -> None:
            for g, w, b in zip(grads, weights, biases):
                if g is not None:
                    _weight_grads(w, b, g, full)

        if deferred:
            ctx.store.defer(lambda: weight_grads(_gather(shard, 1, group)), params,
                            (shard, *[g for g in grads if g is not None]))
            return (grad_shard, None, None) + (None,) * (2 * len(weights))
        laid_out, handle = later
        if handle is not None:
            handle.wait()
        full = laid_out()
        out = []
        for g, w, b in zip(grads, weights, biases):
            if g is None:
                out += [None, None]
                continue
            out.append(_flat(g).t().matmul(_flat(full)))
            out.append(_flat(g).sum(dim=0) if b is not None else None)
        return (grad_shard, None, None, *out)


class _EmbeddingDeferW(torch.autograd.Function):
    """F.embedding(ids, weight); the weight's gradient in W when a store is capturing."""

    @staticmethod
    def forward(ctx, ids, weight, store):
        ctx.save_for_backward(ids)
        ctx.store, ctx.weight, ctx.rows = store, weight, weight.shape[0]
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight, rows = ctx.weight, ctx.rows

        def weight_grad() -> torch.Tensor:
            return torch.ops.aten.embedding_dense_backward(grad, ids, rows, -1, False)

        if ctx.store is not None and ctx.store.defer(lambda: accumulate(weight, weight_grad()),
                                                     (weight,), (grad, ids)):
            return None, None, None
        return None, weight_grad(), None


def linear_defer_w(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   store: WeightGradStore | None) -> torch.Tensor:
    return apply_split(_LinearDeferW, store, x, weight, bias, store)


def seq_gather_linear(shard: torch.Tensor, weights, biases, group,
                      store: WeightGradStore | None):
    """One output per weight, (b, s, out_i/tp), from the (b, s/tp, h) shard."""
    params = [p for w, b in zip(weights, biases) for p in (w, b)]
    return apply_split(_SeqGatherLinearReduceScatter, store, shard, group, store, *params)


def embedding_defer_w(ids: torch.Tensor, weight: torch.Tensor,
                      store: WeightGradStore | None) -> torch.Tensor:
    return apply_split(_EmbeddingDeferW, store, ids, weight, store)
