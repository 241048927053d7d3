"""SwiGLU activation, silu(gate) * up, as used by Llama-style MLPs.

- NPU: ``torch_npu.npu_swiglu(x, dim=-1)`` takes ONE tensor and splits it in two halves along
  ``dim``: it returns silu(A) * B with A the FIRST half and B the second. So the gate goes first:
  x = cat(gate, up). The concatenation costs a copy; a model that produces gate and up from one
  fused projection can lay its output out as (..., [gate | up]) and pay nothing.
- CUDA: ``F.silu(gate) * up`` compiled regionally (kernels/compiled.py: one inductor kernel
  forward and one backward per shape; the plain expression inside a compiled model).
- CPU: ``F.silu(gate) * up``.

``swiglu_packed_backward(grad, x)`` is its derivative as one call (compiled on CUDA), for a
backward written out by hand. ``swiglu_packed(x)`` takes that one tensor, x = [gate | up] along the last dim, as a fused gate-up
projection produces it (the grouped-GEMM experts, models/moe/experts.py): on the NPU it is
npu_swiglu's input as it is (no concatenation), elsewhere silu of the first half times the second.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.compiled import compiled, use_compiled
from kernels.dispatch import KernelPaths, device_kind, import_torch_npu

NPU_SWIGLU_DIM = -1


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")


def npu_swiglu_input(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The single input npu_swiglu expects: cat(gate, up) along the last dim, (..., 2f), contiguous."""
    return torch.cat((gate, up), dim=NPU_SWIGLU_DIM)


def swiglu(gate: torch.Tensor, up: torch.Tensor, paths: KernelPaths | None = None) -> torch.Tensor:
    """silu(gate) * up for gate, up (..., f); returns (..., f). ``paths``: the chip's fused ops
    (None: all); without ``swiglu`` an NPU runs the plain expression."""
    _check(gate, up)
    kind = device_kind(gate)
    if kind == "npu" and (paths is None or paths.swiglu):
        torch_npu = import_torch_npu()
        return torch_npu.npu_swiglu(npu_swiglu_input(gate, up), dim=NPU_SWIGLU_DIM)
    if use_compiled(kind):
        return compiled("swiglu")(gate, up)
    return F.silu(gate) * up


def swiglu_packed(x: torch.Tensor, paths: KernelPaths | None = None) -> torch.Tensor:
    """silu(x[..., :f]) * x[..., f:] for x (..., 2f) = [gate | up]; returns (..., f)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: the last dim holds [gate | up], an even size; got {tuple(x.shape)}")
    kind = device_kind(x)
    if kind == "npu" and (paths is None or paths.swiglu):
        torch_npu = import_torch_npu()
        return torch_npu.npu_swiglu(x, dim=NPU_SWIGLU_DIM)
    if use_compiled(kind):
        return compiled("swiglu_packed")(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_packed_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu_packed`` at x (..., 2f) for the output gradient ``grad`` (..., f):
    (..., 2f) = [d gate | d up], the ops autograd runs for the plain expression (silu's own
    derivative, two products, one concatenation); compiled regionally on CUDA, the expression
    elsewhere. For a backward written out by hand (kernels/grouped_experts.py)."""
    if x.shape[-1] != 2 * grad.shape[-1]:
        raise ValueError(f"swiglu_packed_backward: x (..., 2f) and grad (..., f), got "
                         f"{tuple(x.shape)} and {tuple(grad.shape)}")
    if use_compiled(device_kind(x)):
        return compiled("swiglu_packed_backward")(grad, x)
    gate, up = x.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate * sigmoid(gate) * up in fp32, cast back to gate's dtype."""
    _check(gate, up)
    g, u = gate.float(), up.float()
    return (g * torch.sigmoid(g) * u).to(gate.dtype)
