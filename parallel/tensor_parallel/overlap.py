"""``--tp-comm-overlap``: the sequence-parallel all-gather before a column-parallel GEMM and the
reduce-scatter after a row-parallel GEMM, decomposed into tp chunks and pipelined with the GEMMs
on those chunks (docs/communication.md, "TP communication overlap"). One autograd.Function per
pattern, named by its forward/backward pair:

- ``_RingGatherLinearReduceScatter`` (column-parallel, one or several weights on one input):
  forward all-gather ring + per-chunk GEMMs; backward per-chunk input-gradient GEMMs +
  reduce-scatter ring, and in the same loop the input re-gathered for the weight gradients on an
  all-gather ring, its chunks travelling while the input-gradient GEMMs run. It saves only the
  shard.
- ``_RingLinearReduceScatterGather`` (row-parallel): forward per-chunk GEMMs + reduce-scatter
  ring; backward all-gather ring of the output gradient + per-chunk input-gradient GEMMs.

The weight-gradient GEMM itself runs once on the gathered operand (dW = dy^T x, as the plain
layers compute it): done chunk by chunk its sum would be reordered, and the overlapped layers are
held to the plain ones within 1e-6. With a capturing ``WeightGradStore`` (zero-bubble schedules) B
runs only the input-gradient ring and W the weight gradients: the column W re-gathers the shard
with one all-gather (a TP collective, as in split_linear.py: every TP rank of a stage runs the same
W actions in the same order; in W there is no GEMM left to hide it behind), the row W reads the
output gradient B gathered.

With an ``Fp8Spec`` (parallel/tensor_parallel/fp8.py) every GEMM of the rings runs on float8
operands, each chunk quantized with the scale of the whole logical tensor (agreed over the groups
before the ring starts; rowwise per-token scales of gathered chunks from the chunk's own rows); the
fused ops are bf16-only here, so FP8 always takes the ring.

Which implementation runs is chosen per call by ``overlap_fused.fused_path`` (the chunked ring,
``ring.py``, is the reference and runs everywhere; the fused CUDA / Ascend ops replace the
forward GEMM+collective where probed available). Under ``torch.compile`` the Functions run
eagerly (a graph break): the ring is a Python loop over asynchronous handles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.runtime.comm import group_size
from parallel.runtime.module_attrs import set_where_present
from parallel.tensor_parallel.fp8 import Fp8Backward, Fp8Forward, Fp8Spec
from parallel.tensor_parallel.mappings import _check_divisible, _gather
from parallel.tensor_parallel.overlap_fused import fused_path
from parallel.tensor_parallel.ring import SEQ, chunk_of, ring_pass
from parallel.tensor_parallel.split_linear import linear_defer_w
from parallel.grads.weight_grad import WeightGradStore, accumulate, accumulate_matmul, apply_eager


def _flat(t: torch.Tensor) -> torch.Tensor:  # (..., n) -> (N, n)
    return t.reshape(-1, t.shape[-1])


def _column_forward(shard, group, weights, biases, path, fp8: Fp8Forward | None = None):
    """(b, s/n, h) -> one (b, s, o_i) per weight."""
    if path is not None:
        outs = path.all_gather_matmul(shard, [w.t() for w in weights], group)[1]
        return [o if b is None else o + b for o, b in zip(outs, biases)]
    n = group.size
    pieces = [[None] * n for _ in weights]

    def gemms(c: int, x_c: torch.Tensor) -> None:  # x_c (b, s/n, h): chunk c's GEMMs
        for i, (w, b) in enumerate(zip(weights, biases)):
            pieces[i][c] = (F.linear(x_c, w, b) if fp8 is None       # (b, s/n, o_i)
                            else fp8.linear(x_c, i, b, chunk=(c, n)))
    ring_pass(group, shard, on_chunk=gemms)
    return [torch.cat(p, dim=SEQ) for p in pieces]


def _weight_grads(grads, weights, biases, full: torch.Tensor, into_params: bool,
                  fp8: Fp8Backward | None = None) -> list:
    """dW_i = dy_i^T x, db_i = sum dy_i from the gathered (b, s, h) input, one GEMM per weight (as
    the plain layer computes them, so the results are the same); into the parameters (W) or
    returned as [dW_0, db_0, dW_1, db_1, ...]. With ``fp8`` the GEMMs on float8 operands."""
    out = []
    for i, (g, w, b) in enumerate(zip(grads, weights, biases)):
        if g is None:
            out += [None, None]
        elif fp8 is not None:
            gw, gb = fp8.wgrad(g, full, i), _flat(g).sum(dim=0) if b is not None else None
            if into_params:
                accumulate(w, gw)
                if gb is not None:
                    accumulate(b, gb)
            else:
                out += [gw, gb]
        elif into_params:
            accumulate_matmul(w, _flat(g).t(), _flat(full))
            if b is not None:
                accumulate(b, _flat(g).sum(dim=0))
        else:
            out += [_flat(g).t().matmul(_flat(full)), _flat(g).sum(dim=0) if b is not None else None]
    return out


def _ring_gather_into(group, shard, partial=None):
    """The all-gather ring of ``shard`` into a (b, s, h) tensor, each chunk landing while the next
    travels (and, with ``partial``, the reduce-scatter ring's GEMMs run); returns (full, reduced)."""
    n = group.size
    pieces = [None] * n

    def keep(c: int, x_c: torch.Tensor) -> None:
        pieces[c] = x_c
    reduced = ring_pass(group, shard, on_chunk=keep, partial=partial)
    return torch.cat(pieces, dim=SEQ), reduced


class _RingGatherLinearReduceScatter(torch.autograd.Function):
    """Column-parallel linear(s) on a sequence shard, overlapped (module docstring).
    ``params`` is (weight_0, bias_0, weight_1, bias_1, ...); a bias may be None."""

    @staticmethod
    def forward(ctx, shard, group, store, mode, fp8, *params):
        weights, biases = params[0::2], params[1::2]
        path = fused_path(shard, group, mode) if fp8 is None else None
        ctx.fp8 = None if fp8 is None else Fp8Forward(fp8, shard, weights)
        ctx.save_for_backward(shard)
        ctx.group, ctx.store, ctx.weights, ctx.biases, ctx.path = group, store, weights, biases, path
        outs = tuple(_column_forward(shard, group, weights, biases, path, ctx.fp8))
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        (shard,) = ctx.saved_tensors
        group, weights, biases, path = ctx.group, ctx.weights, ctx.biases, ctx.path
        n = group.size
        live = [(i, g, w) for i, (g, w) in enumerate(zip(grads, weights)) if g is not None]
        fp8 = None if ctx.fp8 is None else Fp8Backward(ctx.fp8, grads, shard)

        def partial(c: int) -> torch.Tensor:       # (b, s/n, h): this rank's dx for chunk c
            total = None
            for i, g, w in live:
                part = (chunk_of(g, c, n).matmul(w) if fp8 is None
                        else fp8.dgrad(chunk_of(g, c, n), i, chunk=(c, n)))
                total = part if total is None else total + part
            return total
        params = [p for w, b in zip(weights, biases) for p in (w, b) if p is not None]
        deferred = ctx.store is not None and ctx.store.capturing
        if deferred or path is not None:
            if path is not None:                    # fused GEMM + reduce-scatter
                g_cat = torch.cat([g for _, g, _ in live], dim=-1)    # (b, s, sum o_i)
                w_cat = torch.cat([w for _, _, w in live], dim=0)     # (sum o_i, h)
                grad_shard = path.matmul_reduce_scatter(g_cat, w_cat, group)
            else:
                grad_shard = ring_pass(group, partial=partial)
            if deferred:   # W: nothing left to hide the gather behind, so one all-gather
                ctx.store.defer(lambda: _weight_grads(grads, weights, biases,
                                                      _gather(shard, SEQ, group), True, fp8),
                                params, (shard, *[g for _, g, _ in live]))
                return (grad_shard, None, None, None, None) + (None,) * (2 * len(weights))
            full = _gather(shard, SEQ, group)       # (b, s, h) the weight GEMMs' input
            return (grad_shard, None, None, None, None,
                    *_weight_grads(grads, weights, biases, full, False, fp8))
        # one loop, two rings: the input's chunks arrive for the weight GEMMs while the
        # input-gradient GEMMs run and their partial sums travel
        full, grad_shard = _ring_gather_into(group, shard, partial=partial)
        return (grad_shard, None, None, None, None,
                *_weight_grads(grads, weights, biases, full, False, fp8))


class _RingLinearReduceScatterGather(torch.autograd.Function):
    """Row-parallel linear, overlapped: forward GEMMs + reduce-scatter ring (b, s, in/tp) ->
    (b, s/tp, out) partial sums reduced; backward all-gather ring of the output gradient + GEMMs.
    No bias: the row-parallel layer adds it after the reduction."""

    @staticmethod
    def forward(ctx, x, weight, group, store, mode, fp8):
        n = group.size
        _check_divisible(x, SEQ, n)
        path = fused_path(x, group, mode) if fp8 is None else None
        ctx.save_for_backward(x)
        ctx.group, ctx.store, ctx.weight, ctx.path = group, store, weight, path
        ctx.fp8 = None if fp8 is None else Fp8Forward(fp8, x, [weight])
        if path is not None:
            return path.matmul_reduce_scatter(x, weight.t(), group)
        if ctx.fp8 is not None:
            return ring_pass(group, partial=lambda c: ctx.fp8.linear(chunk_of(x, c, n), 0,
                                                                     chunk=(c, n)))
        return ring_pass(group, partial=lambda c: F.linear(chunk_of(x, c, n), weight))

    @staticmethod
    def backward(ctx, grad):  # grad (b, s/tp, out)
        (x,) = ctx.saved_tensors
        group, weight, path = ctx.group, ctx.weight, ctx.path
        n = group.size
        deferred = ctx.store is not None and ctx.store.capturing
        if ctx.fp8 is not None:
            return _row_ring_fp8_backward(ctx, x, grad, deferred)
        if path is not None:   # fused all-gather + GEMM, the gathered gradient for the weights
            g_full, (grad_x,) = path.all_gather_matmul(grad, [weight], group, gather=True)
            if deferred:
                ctx.store.defer(lambda: accumulate_matmul(weight, _flat(g_full).t(), _flat(x)),
                                (weight,), (g_full, x))
                return grad_x, None, None, None, None, None
            return grad_x, _flat(g_full).t().matmul(_flat(x)), None, None, None, None
        dx, g_chunks = [None] * n, [None] * n

        def gemms(c: int, g_c: torch.Tensor) -> None:   # g_c (b, s/n, out)
            dx[c] = g_c.matmul(weight)                   # (b, s/n, in/tp)
            g_chunks[c] = g_c
        ring_pass(group, grad, on_chunk=gemms)
        grad_x = torch.cat(dx, dim=SEQ)                  # (b, s, in/tp)
        g_full = torch.cat(g_chunks, dim=SEQ)            # (b, s, out)
        if deferred:
            ctx.store.defer(lambda: accumulate_matmul(weight, _flat(g_full).t(), _flat(x)),
                            (weight,), (g_full, x))
            return grad_x, None, None, None, None, None
        return grad_x, _flat(g_full).t().matmul(_flat(x)), None, None, None, None


def _row_ring_fp8_backward(ctx, x, grad, deferred: bool) -> tuple:
    """``_RingLinearReduceScatterGather``'s backward in FP8: the output gradient's shard sets its
    scales (agreed before the ring), each gathered chunk's input-gradient GEMM runs in float8, the
    weight gradient on the gathered gradient (in W when deferred)."""
    group, weight, n = ctx.group, ctx.weight, ctx.group.size
    bw = Fp8Backward(ctx.fp8, [grad], x)
    dx, g_chunks = [None] * n, [None] * n

    def gemms(c: int, g_c: torch.Tensor) -> None:   # g_c (b, s/n, out)
        dx[c] = bw.dgrad(g_c, 0, chunk=(c, n))       # (b, s/n, in/tp)
        g_chunks[c] = g_c
    ring_pass(group, grad, on_chunk=gemms)
    grad_x = torch.cat(dx, dim=SEQ)                  # (b, s, in/tp)
    g_full = torch.cat(g_chunks, dim=SEQ)            # (b, s, out)
    if deferred:
        ctx.store.defer(lambda: accumulate(weight, bw.wgrad(g_full, x, 0)), (weight,), (g_full, x))
        return grad_x, None, None, None, None, None
    return grad_x, bw.wgrad(g_full, x, 0), None, None, None, None


class _MatmulAllReduceForwardIdentityBackward(torch.autograd.Function):
    """Row-parallel GEMM + all-reduce without sequence parallelism, as one fused op
    (``path.matmul_all_reduce``: Ascend's MC2 matmul-all-reduce); the backward is the plain
    layer's (the all-reduce's backward is the identity): dx = dy W, dW = dy^T x (deferred to
    the W action under a zero-bubble schedule)."""

    @staticmethod
    def forward(ctx, x, weight, group, store, path):
        ctx.save_for_backward(x)
        # the Parameter itself (as every split Function keeps it): under recomputation a saved
        # tensor comes back as a detached copy, and the deferred W would accumulate into that
        ctx.weight, ctx.store = weight, store
        return path.matmul_all_reduce(x, weight.t(), group)   # (b, s, out)

    @staticmethod
    def backward(ctx, grad):  # grad (b, s, out)
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_x = grad.matmul(weight)                          # (b, s, in/tp)
        if ctx.store is not None and ctx.store.capturing:
            ctx.store.defer(lambda: _weight_grads([grad], [weight], [None], x, True), [weight],
                            (x, grad))
            return grad_x, None, None, None, None
        return grad_x, _weight_grads([grad], [weight], [None], x, False)[0], None, None, None


def _apply(fn, *args):
    """``fn.apply``, outside any torch.compile graph (the ring's handles are Python state)."""
    if torch.compiler.is_compiling():
        return apply_eager(fn, *args)
    return fn.apply(*args)


def ring_gather_linear(shard: torch.Tensor, weights, biases, group,
                       store: WeightGradStore | None = None, mode: str = "auto",
                       fp8: Fp8Spec | None = None):
    """Overlapped ``seq_gather_linear``: one output per weight, (b, s, out_i/tp), from the
    (b, s/tp, h) shard. ``mode``: "auto" (a fused op where ``fused_path`` finds one, else the
    ring) or "ring"."""
    if group_size(group) == 1:
        outs = tuple(F.linear(shard, w, b) if fp8 is None else linear_defer_w(shard, w, b, store, fp8)
                     for w, b in zip(weights, biases))
        return outs if len(outs) > 1 else outs[0]
    params = [p for w, b in zip(weights, biases) for p in (w, b)]
    return _apply(_RingGatherLinearReduceScatter, shard, group, store, mode, fp8, *params)


def ring_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group,
                               store: WeightGradStore | None = None,
                               mode: str = "auto", fp8: Fp8Spec | None = None) -> torch.Tensor:
    """Overlapped row-parallel GEMM + ``reduce_scatter_to_sequence``: (b, s, in/tp) -> (b, s/tp,
    out), the partial sums reduced (no bias)."""
    if group_size(group) == 1:
        return F.linear(x, weight) if fp8 is None else linear_defer_w(x, weight, None, store, fp8)
    return _apply(_RingLinearReduceScatterGather, x, weight, group, store, mode, fp8)


def fused_linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, group,
                            store: WeightGradStore | None = None, mode: str = "auto"):
    """Without sequence parallelism: the row-parallel GEMM and its all-reduce as one fused op
    where ``fused_path`` finds one that has it ((b, s, in/tp) -> (b, s, out), no bias), else
    None: the caller runs the plain layer (nothing to pipeline on the other backends)."""
    path = fused_path(x, group, mode) if group_size(group) > 1 else None
    if path is None or not hasattr(path, "matmul_all_reduce"):
        return None
    return _apply(_MatmulAllReduceForwardIdentityBackward, x, weight, group, store, path)


OVERLAP_MODES = ("auto", "ring")


def set_tp_comm_overlap(modules, mode: str | None = "auto") -> int:
    """Turn the overlap on ("auto": fused ops where probed, else the ring; "ring": always the
    ring) or off (None) in every TP linear layer of ``modules``; returns how many layers. It acts
    only where the layer runs under sequence parallelism (the config refuses the flag without)."""
    if mode is not None and mode not in OVERLAP_MODES:
        raise ValueError(f"tp_comm_overlap mode must be one of {OVERLAP_MODES} or None, got {mode!r}")
    return set_where_present(modules, "tp_comm_overlap", mode)
