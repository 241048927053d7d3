"""LayerNorm and RMSNorm over the last dimension, fused per device, with fp32 references.

- LayerNorm: ``F.layer_norm`` on every device; on NPU it lowers to the native fused LayerNorm kernel
  (torch_npu registers it for the aten op), so no separate NPU call is needed.
- RMSNorm: ``torch_npu.npu_rms_norm`` on NPU, ``F.rms_norm`` (a single fused aten op) elsewhere.

Weights and biases are cast to the input's dtype before the call: the fused kernels require matching
dtypes (npu_rms_norm documents it; the CPU/CUDA kernels fall back to an unfused path otherwise), and
the output keeps the input's dtype, as the references do. Under mixed precision the cast is part of
the autograd graph, so an fp32 master weight still receives its gradient in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import KernelPaths, device_kind, import_torch_npu


def _check_param(x: torch.Tensor, p: torch.Tensor | None, name: str) -> None:
    if p is not None and tuple(p.shape) != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape ({x.shape[-1]},) to match the input's last dimension; "
            f"got {tuple(p.shape)}"
        )


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim of x (..., h)."""
    _check_param(x, weight, "weight")
    _check_param(x, bias, "bias")
    w = weight.to(x.dtype)
    b = bias.to(x.dtype) if bias is not None else None
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def npu_rms_norm_args(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    """Positional and keyword arguments for torch_npu.npu_rms_norm (gamma in x's dtype)."""
    return (x, weight.to(x.dtype)), {"epsilon": float(eps)}


def unpack_npu_rms_norm_output(result) -> torch.Tensor:
    """npu_rms_norm returns (y, rstd); rstd is only kept for its backward."""
    return result[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
             paths: KernelPaths | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim of x (..., h). ``paths``: the chip's
    fused ops (None: all); without ``rms_norm`` an NPU runs F.rms_norm."""
    _check_param(x, weight, "weight")
    if device_kind(x) == "npu" and (paths is None or paths.rms_norm):
        torch_npu = import_torch_npu()
        args, kwargs = npu_rms_norm_args(x, weight, eps)
        return unpack_npu_rms_norm_output(torch_npu.npu_rms_norm(*args, **kwargs))
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm in plain fp32 math (biased variance, as F.layer_norm), cast back to x's dtype."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (xf - mean) / torch.sqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm in plain fp32 math, cast back to x's dtype."""
    xf = x.float()
    rms = torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    return (xf / rms * weight.float()).to(x.dtype)
