"""Element-wise ops compiled regionally: the CUDA paths of RoPE and SwiGLU (kernels/rope.py,
kernels/swiglu.py; SwiGLU's packed derivative too, which the experts' grouped MLP calls in its
hand-written backward, kernels/grouped_experts.py).

On a GPU the plain expressions run as several kernels each (RoPE: a chunk, a negation, a
concatenation, two products and a sum; SwiGLU: silu and a product), every one reading and writing
the whole activation, forward and backward. Here each expression is handed once to
``torch.compile`` (inductor; ``fullgraph=True``): one generated kernel forward and one backward
per shape, with no graph of the model around it, so an eager run gets them too. RoPE and the
dense SwiGLU see a model's few shapes and compile static; the packed SwiGLU and its derivative
(``DYNAMIC``) take the experts' rows, whose count changes every call, and compile with dynamic
sizes: one kernel for every row count (with static sizes each new count would be a compilation
inside a step, up to ``Regional``'s limit, while the other EP ranks wait).
Under ``--compile`` the model's own graph already fuses them, and the plain expression is used
(``torch.compiler.is_compiling()``).

The compiled functions are made on first use and kept (``Regional``): torch.compile caches one
graph per input signature (shapes, strides, dtypes, grad mode) and, with ``fullgraph=True``, raises
instead of running eagerly once a function has more signatures than Dynamo's recompile limit (8),
or when a Python dispatch mode is active (the stream checker's, the host-wait counter's).
``Regional`` compiles up to its own limit of signatures (64: FP8's quantization sees every GEMM's
operands and gradients, kernels/fp8.py) and runs the expression eagerly for any beyond it and under
a dispatch mode, so a model with many shapes or a checked run gets the same values, never an error.
With dynamic sizes a signature tells sizes apart only as 0, 1 or more (as Dynamo's guards do; a
Parameter's exactly, which Dynamo keeps static), so the limit counts compilations, not the row
counts met. The references they are tested against are the ops' own (``apply_rope_reference``,
``swiglu_reference``); the functions run on any device inductor supports, the CPU included, which
is how the tests check them.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_packed(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_packed_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    silu = F.silu(gate)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * silu], dim=-1)


_EXPRESSIONS = {"rope": _rope, "swiglu": _swiglu, "swiglu_packed": _swiglu_packed,
                "swiglu_packed_backward": _swiglu_packed_backward}


def _sizes(t: torch.Tensor, dynamic: bool) -> tuple:
    """A tensor's sizes and strides as Dynamo's guards tell them apart: exactly under static
    shapes, and for a Parameter (static even under dynamic ones: Dynamo's
    ``force_parameter_static_shapes``); with dynamic ones only as 0, 1 or more (Dynamo
    specialises 0 and 1), and whether the tensor is contiguous."""
    if not dynamic or (isinstance(t, torch.nn.Parameter)
                       and torch._dynamo.config.force_parameter_static_shapes):
        return tuple(t.shape), t.stride()
    return (tuple(min(s, 2) for s in t.shape), tuple(min(s, 2) for s in t.stride()),
            t.is_contiguous())


def _signature(args: tuple, dynamic: bool = False) -> tuple:
    """What Dynamo's guards tell apart in a call of pure tensor expressions: each tensor's sizes
    and strides (``_sizes``), dtype, device and requires_grad, the other arguments' values, the
    grad mode."""
    return (torch.is_grad_enabled(),) + tuple(
        (_sizes(a, dynamic), a.dtype, a.device, a.requires_grad)
        if isinstance(a, torch.Tensor) else a for a in args)


class Regional:
    """``fn`` compiled alone (``fullgraph=True``, static shapes unless ``dynamic``: one kernel for
    every size, fewer compilations where the sizes vary) for its first ``limit``
    signatures (Dynamo's recompile limit raised to that while a new one compiles: a model's FP8
    quantization meets a dozen); further signatures, and every call while a Python dispatch mode
    is active, run ``fn`` eagerly (the same values). Should Dynamo still refuse a call (a guard
    the signature does not model), that signature runs eagerly from then on; should the backend
    fail to build it (no working triton), every call does, after one note line."""

    def __init__(self, fn, backend="inductor", limit: int = 64, dynamic: bool = False):
        from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit  # imported
        self.refused, self.failed = FailOnRecompileLimitHit, BackendCompilerFailed  # when used
        self.fn = fn
        self.compiled_fn = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)
        self.dynamic = dynamic
        self.compiled: set = set()   # signatures handed to the compiled function
        self.eager: set = set()      # signatures beyond the limit, or refused
        self.broken = False          # the backend failed to build it: eager from then on
        self.limit = limit

    def __call__(self, *args):
        if self.broken or torch._C._len_torch_dispatch_stack() > 0:  # dispatch modes: not traced
            return self.fn(*args)
        key = _signature(args, self.dynamic)
        if key in self.eager or (key not in self.compiled and len(self.compiled) >= self.limit):
            self.eager.add(key)
            return self.fn(*args)
        try:
            if key in self.compiled:
                out = self.compiled_fn(*args)
            else:  # a new signature: this function's own limit, not the process's
                with torch._dynamo.config.patch(recompile_limit=max(
                        self.limit, torch._dynamo.config.recompile_limit)):
                    out = self.compiled_fn(*args)
        except self.refused:  # refused before it ran anything: run it here
            self.compiled.discard(key)
            self.eager.add(key)
            return self.fn(*args)
        except self.failed as exc:  # e.g. no working triton: slower, not wrong; said once
            self.broken = True
            why = next((ln for ln in str(exc).splitlines() if "Error" in ln), type(exc).__name__)
            print(f"gridtron: note: torch.compile could not build {self.fn.__name__} "
                  f"({why.strip()}); it runs uncompiled", file=sys.stderr, flush=True)
            return self.fn(*args)
        self.compiled.add(key)
        return out


# the experts' activation and its derivative: their row count (the tokens routed to this rank's
# experts) changes every call, so one kernel for every count instead of one compilation per count
DYNAMIC = frozenset({"swiglu_packed", "swiglu_packed_backward"})


@functools.lru_cache(maxsize=None)  # one compiled function per op and process
def compiled(op: str) -> Regional:
    """The compiled expression of ``op`` ("rope", "swiglu", "swiglu_packed",
    "swiglu_packed_backward"); dynamic sizes for the ops in ``DYNAMIC``."""
    return Regional(_EXPRESSIONS[op], dynamic=op in DYNAMIC)


def use_compiled(kind: str) -> bool:
    """Whether an op on a device of ``kind`` (kernels.dispatch.device_kind) takes the compiled
    expression: on CUDA, outside a compiled graph."""
    return kind == "cuda" and not torch.compiler.is_compiling()
