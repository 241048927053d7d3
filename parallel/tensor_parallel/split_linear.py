"""Linear and embedding layers' autograd Functions with the weight gradient split off (the W of a
zero-bubble schedule, parallel/grads/weight_grad.py), one per communication pattern:

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

With an ``Fp8Spec`` (``fp8``, parallel/tensor_parallel/fp8.py) the first two run their GEMMs on
float8 operands: the scales are agreed over the groups in forward and in B (the W closures hold
them), so W runs the weight-gradient GEMM alone.

Each applies its weight gradient through ``accumulate`` / ``accumulate_matmul``: straight into
``main_grad`` when deferred, returned to autograd otherwise. Parameters are kept on ``ctx`` as the
Parameter objects (only activations go through ``save_for_backward``): under activation
checkpointing a saved tensor comes back in backward as a recomputed alias, and W must accumulate
into the parameter itself. Under ``torch.compile`` these calls run
outside the compiled graph when a store is attached (``torch.compiler.disable``): the W closures
are Python side effects of backward that a traced backward graph cannot hold. Where no gradient
is recorded (evaluation), ``seq_gather_linear`` runs its forward math without the Function.
"""
from __future__ import annotations

import torch

from parallel.tensor_parallel.fp8 import Fp8Backward, Fp8Forward, Fp8Spec
from parallel.tensor_parallel.mappings import _gather, _reduce_scatter
from parallel.grads.weight_grad import WeightGradStore, accumulate, accumulate_matmul, apply_split


def _flat(t: torch.Tensor) -> torch.Tensor:  # (..., n) -> (N, n)
    return t.reshape(-1, t.shape[-1])


def _weight_grads(weight, bias, grad: torch.Tensor, x: torch.Tensor) -> None:
    """Accumulate dW = dy^T x and db = sum dy (any leading dims) into the parameters."""
    accumulate_matmul(weight, _flat(grad).t(), _flat(x))
    if bias is not None:
        accumulate(bias, _flat(grad).sum(dim=0))


def _fp8_weight_grads(bw: Fp8Backward, weights, biases, grads, x: torch.Tensor) -> None:
    """The FP8 weight gradients (and the biases', in the gradients' dtype) into the parameters."""
    for i, (g, w, b) in enumerate(zip(grads, weights, biases)):
        if g is not None:
            accumulate(w, bw.wgrad(g, x, i))
            if b is not None:
                accumulate(b, _flat(g).sum(dim=0))


class _LinearDeferW(torch.autograd.Function):
    """y = x W^T + b, weight gradients in W when a store is capturing (module docstring); with
    ``fp8`` the three GEMMs in float8."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, fp8):
        ctx.save_for_backward(x)
        # the parameters themselves, not saved tensors: under activation checkpointing a saved
        # tensor comes back as a recomputed alias, and W must accumulate into the Parameter
        ctx.store, ctx.weight, ctx.bias = store, weight, bias
        if fp8 is None:
            ctx.fp8 = None
            return torch.nn.functional.linear(x, weight, bias)
        ctx.fp8 = Fp8Forward(fp8, x, [weight])   # (b, s, in) x and W's scales, agreed
        return ctx.fp8.linear(x, 0, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        params = (weight,) if bias is None else (weight, bias)
        if ctx.fp8 is not None:
            bw = Fp8Backward(ctx.fp8, [grad], x)
            grad_x = bw.dgrad(grad, 0) if ctx.needs_input_grad[0] else None
            if ctx.store is not None and ctx.store.capturing:
                bw.defer_wgrad()
            if ctx.store is not None and ctx.store.defer(
                    lambda: _fp8_weight_grads(bw, [weight], [bias], [grad], x), params, (grad, x)):
                return grad_x, None, None, None, None
            gb = _flat(grad).sum(dim=0) if bias is not None and ctx.needs_input_grad[2] else None
            return grad_x, bw.wgrad(grad, x, 0), gb, None, None
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.store is not None and ctx.store.defer(lambda: _weight_grads(weight, bias, grad, x),
                                                     params, (grad, x)):
            return grad_x, None, None, None, None
        gw = _flat(grad).t().matmul(_flat(x))
        gb = _flat(grad).sum(dim=0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_x, gw, gb, None, None


def _seq_gather_forward(shard, group, fp8, weights, biases):
    """``_SeqGatherLinearReduceScatter``'s forward math: all-gather the (b, s/tp, h) shard and
    apply each weight; returns (the output, or the tuple of outputs for several weights; the
    ``Fp8Forward`` holding the agreed scales, or None)."""
    scales = None if fp8 is None else Fp8Forward(fp8, shard, weights)  # of the shard's values
    full = _gather(shard, 1, group)  # (b, s, h)
    if scales is None:
        outs = tuple(torch.nn.functional.linear(full, w, b) for w, b in zip(weights, biases))
    else:
        outs = tuple(scales.linear(full, i, b) for i, b in enumerate(biases))
    return (outs if len(outs) > 1 else outs[0]), scales


class _SeqGatherLinearReduceScatter(torch.autograd.Function):
    """Column-parallel linear(s) on a sequence shard: forward all-gather + GEMMs, backward GEMMs +
    reduce-scatter, the input re-gathered for the weight gradients (module docstring).
    ``params`` is (weight_0, bias_0, weight_1, bias_1, ...); a bias may be None."""

    @staticmethod
    def forward(ctx, shard, group, store, fp8, *params):
        weights, biases = params[0::2], params[1::2]
        out, ctx.fp8 = _seq_gather_forward(shard, group, fp8, weights, biases)
        ctx.save_for_backward(shard)
        ctx.group, ctx.store, ctx.weights, ctx.biases = group, store, weights, biases
        return out

    @staticmethod
    def backward(ctx, *grads):
        (shard,) = ctx.saved_tensors
        group, weights, biases = ctx.group, ctx.weights, ctx.biases
        grads = list(grads)
        if ctx.fp8 is not None:
            return _seq_gather_fp8_backward(ctx, shard, grads)
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
            return (grad_shard, None, None, None) + (None,) * (2 * len(weights))
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
        return (grad_shard, None, None, None, *out)


def _seq_gather_fp8_backward(ctx, shard, grads) -> tuple:
    """``_SeqGatherLinearReduceScatter``'s backward in FP8: the same communication, the GEMMs on
    float8 operands with the scales agreed here (in B: the W closure holds them)."""
    group, weights, biases = ctx.group, ctx.weights, ctx.biases
    bw = Fp8Backward(ctx.fp8, grads, shard)
    deferred = ctx.store is not None and ctx.store.capturing
    later = None if deferred else _gather(shard, 1, group, async_op=not torch.compiler.is_compiling())
    grad_full = None
    for i, g in enumerate(grads):
        if g is not None:
            part = bw.dgrad(g, i)  # (b, s, h)
            grad_full = part if grad_full is None else grad_full + part
    grad_shard = _reduce_scatter(grad_full, 1, group) if grad_full is not None else None
    if deferred:
        bw.defer_wgrad()
        params = [p for w, b in zip(weights, biases) for p in (w, b) if p is not None]
        ctx.store.defer(lambda: _fp8_weight_grads(bw, weights, biases, grads, _gather(shard, 1, group)),
                        params, (shard, *[g for g in grads if g is not None]))
        return (grad_shard, None, None, None) + (None,) * (2 * len(weights))
    if isinstance(later, tuple):
        laid_out, handle = later
        if handle is not None:
            handle.wait()
        full = laid_out()
    else:
        full = later
    out = []
    for i, (g, b) in enumerate(zip(grads, biases)):
        if g is None:
            out += [None, None]
            continue
        out += [bw.wgrad(g, full, i), _flat(g).sum(dim=0) if b is not None else None]
    return (grad_shard, None, None, None, *out)


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
                   store: WeightGradStore | None, fp8: Fp8Spec | None = None) -> torch.Tensor:
    return apply_split(_LinearDeferW, store, x, weight, bias, store, fp8)


def seq_gather_linear(shard: torch.Tensor, weights, biases, group,
                      store: WeightGradStore | None, fp8: Fp8Spec | None = None):
    """One output per weight, (b, s, out_i/tp), from the (b, s/tp, h) shard.

    With nothing to differentiate (an evaluation under ``torch.no_grad``) the forward's math runs
    without the Function: the same values, and no ``ctx`` to fill. It also keeps a compiled chunk
    whole in evaluation: Dynamo inlines a Function's forward when no gradient is recorded, and
    binds a ``forward(ctx, ..., *params)`` one argument off when the varargs hold exactly one
    (weight, bias) pair (``fp8`` received the weight): the trace failed, and Dynamo skipped the
    chunk's forward for the rest of the process, training included (a score of small graphs in
    place of one per chunk)."""
    params = [p for w, b in zip(weights, biases) for p in (w, b)]
    if not _records_grad(shard, params):
        return _seq_gather_forward(shard, group, fp8, tuple(weights), tuple(biases))[0]
    return apply_split(_SeqGatherLinearReduceScatter, store, shard, group, store, fp8, *params)


def _records_grad(x: torch.Tensor, params) -> bool:
    """Whether autograd would record a Function applied to ``x`` and ``params`` (grad mode on
    and some input requiring a gradient)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p is not None and p.requires_grad for p in params))


def embedding_defer_w(ids: torch.Tensor, weight: torch.Tensor,
                      store: WeightGradStore | None) -> torch.Tensor:
    return apply_split(_EmbeddingDeferW, store, ids, weight, store)
