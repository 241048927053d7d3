"""The grouped-GEMM experts' projections with the weight gradients split off (the W of a
zero-bubble schedule, parallel/weight_grad.py): ``_GroupedLinearDeferW``, the grouped counterpart
of ``_LinearDeferW`` (parallel/tensor_parallel/split_linear.py), used by ``LocalExperts`` with
``--moe-grouped-gemm`` when a ``WeightGradStore`` is attached to its experts.

One projection (fc1, gate, up or fc2) over the local experts: row group g of x (``counts[g]``
rows, sorted by expert) times expert g's weight, plus its bias.

- forward: y = x_g W_g^T + b_g per group by ``kernels.grouped_linear`` on the weights stacked per
  call (the same device paths as without a store: ``torch._grouped_mm``, ``npu_grouped_matmul``
  or the loop, kernels/grouped_gemm.py); x and the counts are kept.
- B: dx_g = dy_g W_g per group, by the same kernel on the stacked transposed weights (G, in, out).
- W: one closure per projection, for each expert g dW_g += dy_g^T x_g (``accumulate_matmul``) and
  db_g += sum dy_g (``accumulate``). An expert with no rows gets no GEMM; like the looped experts
  (whose empty GEMM adds zeros) it still ends with a zero gradient where it has no ``main_grad``,
  and the store tells ``on_ready`` about every expert's parameters, so the reducer counts them all.

The per-expert Parameters are passed in and kept on ``ctx`` as the Parameter objects (only x goes
through ``save_for_backward``): under activation checkpointing a saved tensor comes back as a
recomputed alias, and W must accumulate into the Parameter itself. Without a capturing store the
same Function returns the weight gradients to autograd, as ``_LinearDeferW`` does.
"""
from __future__ import annotations

import torch

import kernels
from parallel.weight_grad import WeightGradStore, accumulate, accumulate_matmul, apply_split


def _weight_grads(weights, biases, grads, xs) -> None:
    """Accumulate each expert's dW_g = dy_g^T x_g and db_g = sum dy_g into its parameters."""
    for g, (weight, grad, x) in enumerate(zip(weights, grads, xs)):  # (n_g, out), (n_g, in)
        bias = biases[g] if biases else None
        if grad.shape[0] == 0:  # no rows: no contribution, but a zero gradient as the loop gives
            for p in (weight, bias):
                if p is not None and getattr(p, "main_grad", None) is None:
                    accumulate(p, torch.zeros_like(p))
            continue
        accumulate_matmul(weight, grad.t(), x)           # (out, in)
        if bias is not None:
            accumulate(bias, grad.sum(dim=0))            # (out,)


class _GroupedLinearDeferW(torch.autograd.Function):
    """y_g = x_g W_g^T + b_g per row group, the weight gradients in W when a store is capturing
    (module docstring). ``params``: the G weights (out, in), then the G biases (out,) or none."""

    @staticmethod
    def forward(ctx, x, counts, store, paths, *params):  # x (n, in), counts: G host ints
        n = len(counts)
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x)
        # the parameters themselves, not saved tensors (module docstring)
        ctx.counts, ctx.store, ctx.paths = list(counts), store, paths
        ctx.weights, ctx.biases = weights, biases
        stacked = torch.stack(weights)                                    # (G, out, in)
        bias = torch.stack(biases) if biases else None                    # (G, out)
        return kernels.grouped_linear(x, stacked, ctx.counts, bias, paths)  # (n, out)

    @staticmethod
    def backward(ctx, grad):  # (n, out)
        (x,) = ctx.saved_tensors
        counts, weights, biases = ctx.counts, ctx.weights, ctx.biases
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            with torch.no_grad():
                transposed = torch.stack([w.t() for w in weights])        # (G, in, out)
                grad_x = kernels.grouped_linear(grad, transposed, counts, None, ctx.paths)
        grads, xs = torch.split(grad, counts), torch.split(x, counts)    # (n_g, out), (n_g, in)
        head = (grad_x, None, None, None)
        if ctx.store is not None and ctx.store.defer(
                lambda: _weight_grads(weights, biases, grads, xs), (*weights, *biases), (grad, x)):
            return head + (None,) * (len(weights) + len(biases))
        needs = ctx.needs_input_grad[4:]
        gws = [g.t() @ xg if need else None for g, xg, need in zip(grads, xs, needs)]
        gbs = [g.sum(dim=0) if need else None
               for g, need in zip(grads, needs[len(weights):])]
        return head + tuple(gws) + tuple(gbs)


def grouped_linear_defer_w(x: torch.Tensor, weights, biases, counts,
                           store: WeightGradStore | None, paths=None) -> torch.Tensor:
    """Row group g of x (``counts[g]`` rows) times ``weights[g]`` (out, in) plus ``biases[g]``
    (or no biases: None or empty): (n, in) -> (n, out), dW and db left to W while ``store``
    captures."""
    return apply_split(_GroupedLinearDeferW, store, x, list(counts), store, paths,
                       *weights, *(biases or ()))
