"""The B/W split of zero-bubble schedules: weight gradients computed later than input gradients.

A zero-bubble schedule runs each backward as two actions: B computes the gradient of the chunk's
input (what the previous stage waits for), W the gradients of its weights. The engine's layers do
this inside their own ``torch.autograd.Function``s (parallel/tensor_parallel/split_linear.py, and
the norms here): their backward returns the input gradient and, while a ``WeightGradStore`` is
capturing, hands the weight-gradient work to it as a closure instead of computing it; the
schedule's W action then runs the closures (``store.run(key)``). Autograd runs once; the closures
keep the tensors they need (the layer's saved input and its output gradient) until W.

A closure accumulates straight into the parameter's fp32 ``main_grad`` (the DP reducer's buffer,
parallel/dp/buffers.py: gradient-accumulation fusion, no ``param.grad`` to copy), or into
``param.grad`` for a parameter without one, and the store then tells ``on_ready(param)`` (the
reducer's ``grad_accumulated``) once per W action, after the last closure of that W that
accumulates it, so a bucket is launched when its last W has run. A parameter that also gets a
gradient from autograd in B (a block that reads an engine layer's weight directly besides calling
the layer) is ``note``d by the reducer's hook while B captures, not counted there: it counts once
for its (micro-batch, chunk), with its W. Counted twice, it looked final after half the
micro-batches, and its bucket was reduced before its last W had added its share.

Without a capturing store (every other schedule, pp=1, validation) the same Functions compute the
weight gradients inside B and return them to autograd, exactly as a plain layer does. A module with
its own weights outside these layers (e.g. a user block with ``nn.Linear``) still runs under a
zero-bubble schedule: autograd computes its weight gradients in B, and its W does nothing for it.

``attach_weight_grad_store(modules, store)`` hands the store to every layer that supports the split
(those with a ``weight_grad_store`` attribute); layers of a user's block built from the engine's
layers get it the same way.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch

from parallel.runtime.module_attrs import set_where_present


class _Token:
    """Stands for one queued closure's held tensors (weak-referenceable, unlike object())."""
    __slots__ = ("__weakref__",)


class WeightGradStore:
    """Weight-gradient closures queued by the B of one (micro-batch, chunk), run by its W."""

    def __init__(self, on_ready: Callable[[torch.nn.Parameter], None] | None = None):
        self.on_ready = on_ready
        self.on_hold: Callable[[tuple, object], None] | None = None  # (tensors, token): accounting
        # fn(key, param) once W of ``key`` has accumulated ``param``'s gradient, before on_ready
        # (which may launch its bucket's reduction): fault injection and the anomaly guard's
        # per-micro-batch checks (engine/observe/), which need the micro-batch W knows
        self.accumulated_hooks: list[Callable[[object, torch.nn.Parameter], None]] = []
        self._key = None
        self._queues: dict = {}
        self._noted: dict = {}     # key -> {id: param} autograd accumulated in that key's B

    @property
    def capturing(self) -> bool:
        return self._key is not None

    @contextmanager
    def capture(self, key):
        """While the B of ``key`` runs: the layers queue their weight gradients under ``key``."""
        if self._key is not None:
            raise RuntimeError(f"WeightGradStore: capture({key!r}) inside capture({self._key!r})")
        self._key = key
        self._queues.setdefault(key, [])
        try:
            yield self
        finally:
            self._key = None

    def defer(self, fn: Callable[[], None], params: Iterable[torch.nn.Parameter],
              holds: Iterable[torch.Tensor] = ()) -> bool:
        """Queue ``fn`` (which accumulates the gradients of ``params``) if capturing; returns
        whether it was queued (False: the caller computes the gradients now). ``holds``: the
        tensors ``fn`` keeps alive until it runs (for ``on_hold``, a memory account: it gets the
        tensors and a token that is dropped once the closure has run)."""
        if self._key is None:
            return False
        token = _Token()
        if self.on_hold is not None:
            self.on_hold(tuple(holds), token)
        self._queues[self._key].append((fn, tuple(params), token))
        return True

    def note(self, param: torch.nn.Parameter) -> None:
        """While B captures: autograd accumulated ``param``'s gradient (the reducer's hook); it is
        told to ``on_ready`` with this key's W, once, whatever closures it also has."""
        self._noted.setdefault(self._key, {})[id(param)] = param

    def run(self, key) -> int:
        """Run the closures queued under ``key`` in the order they were queued (the backward's
        order); each parameter is told to ``on_ready`` once, after the last closure that
        accumulates it (a parameter only noted in B: first, its gradient is complete). Returns
        how many ran."""
        queue = self._queues.pop(key, [])
        noted = self._noted.pop(key, {})
        last = {id(p): i for i, (_, params, _) in enumerate(queue) for p in params}
        if self.on_ready is not None:
            for i, p in noted.items():
                if i not in last:
                    self.on_ready(p)
        ran = len(queue)
        for i in range(ran):
            fn, params, token = queue[i]
            queue[i] = None
            with torch.no_grad():  # outside autograd's backward: record nothing
                fn()
            del fn, token                  # what the closure kept goes once it has run
            for p in params:
                if last.get(id(p)) == i:
                    del last[id(p)]
                    for hook in self.accumulated_hooks:
                        hook(key, p)
                    if self.on_ready is not None:
                        self.on_ready(p)
        return ran

    @property
    def pending(self) -> list:
        """Keys whose W has not run yet."""
        return [k for k in dict.fromkeys([*self._queues, *self._noted])
                if self._queues.get(k) or self._noted.get(k)]

    def clear(self) -> None:
        self._queues.clear()
        self._noted.clear()
        self._key = None


def attach_weight_grad_store(modules, store: WeightGradStore | None) -> int:
    """Give ``store`` (None: detach) to every module of ``modules`` that supports the split;
    returns how many got it."""
    return set_where_present(modules, "weight_grad_store", store)


def accumulate(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.main_grad`` (fp32) when the reducer keeps one, else ``param.grad``."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad.view_as(main))
    elif param.grad is None:
        param.grad = grad.to(param.dtype).view_as(param).clone()
    else:
        param.grad.add_(grad.view_as(param.grad))


def accumulate_matmul(param: torch.nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
    """``param``'s gradient += a @ b (2-D): one ``addmm_`` into ``main_grad`` when it has the
    operands' dtype (fp32 training: the GEMM accumulates into the buffer), else the product in the
    operands' dtype added to it (what autograd plus the reducer's hook would do)."""
    main = getattr(param, "main_grad", None)
    if main is not None and main.dtype == a.dtype and main.dim() == 2:
        main.addmm_(a, b)
    else:
        accumulate(param, a @ b)


# ---- norms --------------------------------------------------------------------------------------

class _LayerNormSplit(torch.autograd.Function):
    """LayerNorm whose weight and bias gradients can wait for W: forward ``native_layer_norm``,
    backward ``native_layer_norm_backward`` for the input (B) and for the affine parameters (W),
    each with its own output mask, so each is the fused kernel's own arithmetic."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, store):
        w = weight.to(x.dtype)
        b = bias.to(x.dtype) if bias is not None else None
        out, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), w, b, eps)
        ctx.save_for_backward(x, mean, rstd)  # the parameters stay on ctx (split_linear.py)
        ctx.store, ctx.has_bias, ctx.weight, ctx.bias = store, bias is not None, weight, bias
        return out

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        w = weight.to(x.dtype)
        b = bias.to(x.dtype) if bias is not None else None
        shape = (x.shape[-1],)
        grad_x = torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b,
                                                           [True, False, False])[0]
        params = (weight, bias) if ctx.has_bias else (weight,)

        def weight_grads():
            # the affine gradients read no weight, and W may run after ZeRO-3 freed it
            # (parallel/dp/zero3_units.py): the kernel gets stand-ins of the weights' shape
            ones = torch.ones(shape, dtype=x.dtype, device=x.device)
            _, gw, gb = torch.ops.aten.native_layer_norm_backward(
                grad, x, shape, mean, rstd, ones, ones if ctx.has_bias else None,
                [False, True, ctx.has_bias])
            accumulate(weight, gw)
            if ctx.has_bias:
                accumulate(bias, gb)

        if ctx.store is not None and ctx.store.defer(weight_grads, params, (grad, x, mean, rstd)):
            return grad_x, None, None, None, None
        _, gw, gb = torch.ops.aten.native_layer_norm_backward(grad, x, shape, mean, rstd, w, b,
                                                              [False, True, ctx.has_bias])
        return grad_x, gw.to(weight.dtype), gb.to(bias.dtype) if ctx.has_bias else None, None, None


class _RMSNormSplit(torch.autograd.Function):
    """RMSNorm y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), in fp32 math: B computes
    dx = rstd * (g*w - x_hat * mean(g*w*x_hat)), W computes dw = sum(g * x_hat) over rows."""

    @staticmethod
    def forward(ctx, x, weight, eps, store):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
        out = (xf * rstd).to(x.dtype) * weight.to(x.dtype)
        ctx.save_for_backward(x, rstd)
        ctx.store, ctx.weight = store, weight
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd = ctx.saved_tensors
        weight = ctx.weight
        x_hat = x.float() * rstd
        gw = grad.float() * weight.float()
        grad_x = (rstd * (gw - x_hat * (gw * x_hat).mean(dim=-1, keepdim=True))).to(x.dtype)

        def weight_grad() -> torch.Tensor:
            return (grad.float() * x_hat).reshape(-1, x.shape[-1]).sum(dim=0)

        if ctx.store is not None and ctx.store.defer(lambda: accumulate(weight, weight_grad()),
                                                     (weight,), (grad, x_hat)):
            return grad_x, None, None, None
        return grad_x, weight_grad().to(weight.dtype), None, None


@torch.compiler.disable
def apply_eager(fn, *args):
    """``fn.apply(*args)`` outside any torch.compile graph (Dynamo breaks the graph here). A
    ``torch.compiler.disable`` on the ``autograd.Function`` class itself does not cover its
    ``apply``: the call must be wrapped."""
    return fn.apply(*args)


def apply_split(fn, store: WeightGradStore | None, *args):
    """``fn.apply(*args)``; with a store, outside any torch.compile graph (a graph break while
    Dynamo traces): the W closures are Python side effects of backward that a traced backward
    graph cannot hold. Eager calls skip the wrapper, which costs a frame-evaluation switch."""
    if store is not None and torch.compiler.is_compiling():
        return apply_eager(fn, *args)
    return fn.apply(*args)


def layer_norm_split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                     store: WeightGradStore | None) -> torch.Tensor:
    return apply_split(_LayerNormSplit, store, x, weight, bias, eps, store)


def rms_norm_split(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   store: WeightGradStore | None) -> torch.Tensor:
    return apply_split(_RMSNormSplit, store, x, weight, eps, store)
