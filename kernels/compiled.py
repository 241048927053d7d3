"""Element-wise ops compiled regionally: the CUDA paths of RoPE and SwiGLU (kernels/rope.py,
kernels/swiglu.py; SwiGLU's packed derivative too, which the experts' grouped MLP calls in its
hand-written backward, kernels/grouped_experts.py).

On a GPU the plain expressions run as several kernels each (RoPE: a chunk, a negation, a
concatenation, two products and a sum; SwiGLU: silu and a product), every one reading and writing
the whole activation, forward and backward. Here each expression is handed once to
``torch.compile`` (inductor; ``fullgraph=True``, static shapes): one generated kernel forward and
one backward per shape, with no graph of the model around it, so an eager run gets them too.
Under ``--compile`` the model's own graph already fuses them, and the plain expression is used
(``torch.compiler.is_compiling()``).

The compiled functions are made on first use and kept (``torch.compile`` caches its code per
input shape; a shape beyond its recompile limit runs the expression eagerly, as torch does). The
references they are tested against are the ops' own (``apply_rope_reference``,
``swiglu_reference``); the functions run on any device inductor supports, the CPU included, which
is how the tests check them.
"""
from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=None)  # one compiled function per op and process
def compiled(op: str):
    """The compiled expression of ``op`` ("rope", "swiglu", "swiglu_packed",
    "swiglu_packed_backward")."""
    return torch.compile(_EXPRESSIONS[op], fullgraph=True, dynamic=False)


def use_compiled(kind: str) -> bool:
    """Whether an op on a device of ``kind`` (kernels.dispatch.device_kind) takes the compiled
    expression: on CUDA, outside a compiled graph."""
    return kind == "cuda" and not torch.compiler.is_compiling()
