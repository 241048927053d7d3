"""Device dispatch shared by every kernel in this package.

Each op picks its implementation from the input tensor's ``device.type``, never from a global flag or
an environment variable: the tensor already says where the work happens, and reading it keeps the
kernels free of any dependency on the engine's device module (kernels sit at the bottom of the
dependency order). ``torch_npu`` is imported lazily, inside the NPU branch only, because importing it
on a machine without Ascend CANN breaks ``import torch`` itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

DEVICE_KINDS = ("npu", "cuda", "cpu")

# Which implementation each op uses per device kind. Read-only (a function returns copies), so it is
# a constant table, not module state. "cpu" is also the path for any other device type (mps, xpu,
# meta): those run the same portable torch ops (ring_block: ATen's CPU op on cpu and meta only).
_PATHS: dict[str, dict[str, str]] = {
    "npu": {
        "attention": "torch_npu.npu_fusion_attention (BNSD/BSND, sparse_mode=2 causal; packed documents TND, sparse_mode=3)",
        "layer_norm": "torch.nn.functional.layer_norm (native NPU LayerNorm kernel)",
        "rms_norm": "torch_npu.npu_rms_norm",
        "rope": "torch_npu.npu_rotary_mul (plain expression outside its documented shape limits)",
        "swiglu": "torch_npu.npu_swiglu (gate = first half)",
        "ring_block": "torch_npu.npu_fusion_attention with its softmax statistics (the blockwise fp32 path where the chip table lacks it)",
        "grouped_gemm": "torch_npu.npu_grouped_matmul (x, weight, y one tensor each, group_type=0; the loop where the chip table lacks it)",
    },
    "cuda": {
        "attention": "torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient); packed documents: torch.nn.attention.varlen.varlen_attn (bf16/fp16, causal, no dropout, head_dim a multiple of 8 up to 256, compute capability 8.0+), else a block-diagonal mask",
        "layer_norm": "torch.nn.functional.layer_norm",
        "rms_norm": "torch.nn.functional.rms_norm",
        "rope": "x*cos + rotate_half(x)*sin compiled regionally (torch.compile: one inductor kernel forward, one backward)",
        "swiglu": "silu(gate) * up compiled regionally (torch.compile: one inductor kernel forward, one backward)",
        "ring_block": "aten._scaled_dot_product_flash_attention (bf16/fp16, no mask, compute capability 8.0+, not a causal block with sq != sk) or _efficient_attention, with their log-sum-exp",
        "grouped_gemm": "torch._grouped_mm in bf16 with 16-byte aligned strides over offsets on the device, where the installed torch has it; else a loop of F.linear (reads the offsets)",
    },
    "cpu": {
        "attention": "torch.nn.functional.scaled_dot_product_attention",
        "layer_norm": "torch.nn.functional.layer_norm",
        "rms_norm": "torch.nn.functional.rms_norm",
        "rope": "plain expression x*cos + rotate_half(x)*sin",
        "swiglu": "plain expression silu(gate) * up",
        "ring_block": "aten._scaled_dot_product_flash_attention_for_cpu, with its log-sum-exp (cpu and meta; other device types the tiled fp32 plain math)",
        "grouped_gemm": "torch._grouped_mm (fp32, bf16) over offsets on the device where the installed torch has it; else a loop of F.linear (reads the offsets)",
    },
}

OPS = tuple(_PATHS["cpu"])


@dataclass(frozen=True)
class KernelPaths:
    """Which fused torch_npu ops an NPU runs (True) or replaces by the portable path (False).

    Chosen once per run by the engine's device module from the chip's documented support
    (engine/device/chips.py) and handed down explicitly (models pass it to each kernel call); the kernels
    never look at the chip. Off an NPU only ``cuda_capability`` is read, on CUDA: by ring attention's
    block kernel choice (kernels/attention_lse_cuda.py) and by ``kernels.attention``'s choice of
    ``varlen_attn`` for packed documents (``cuda_varlen_usable``, 8.0 or later); the CPU path reads
    nothing.
    """
    fusion_attention: bool = True   # torch_npu.npu_fusion_attention, else SDPA
    swiglu: bool = True             # torch_npu.npu_swiglu, else silu(gate) * up
    rms_norm: bool = True           # torch_npu.npu_rms_norm, else F.rms_norm
    rotary_mul: bool = True         # torch_npu.npu_rotary_mul, else the rotate-half expression
    grouped_matmul: bool = True     # torch_npu.npu_grouped_matmul, else a loop of GEMMs (MoE experts)
    # which documented shape table npu_rotary_mul is held to (kernels/rope.py ROTARY_TABLES):
    # "a2-a3" (Atlas A2/A3 training series, jit_compile=False, torch_npu's default there) or
    # "atlas-training" (Ascend 910A / 910ProB)
    rotary_table: str = "a2-a3"
    # CUDA compute capability (major, minor), the engine's DeviceInfo.capability: ring attention's
    # blocks call PyTorch's flash kernel, and packed documents varlen_attn, on 8.0 or later only;
    # None: not told (counted as 8.0+)
    cuda_capability: tuple | None = None


ALL_FUSED = KernelPaths()


def device_kind(t: torch.Tensor | torch.device | str) -> str:
    """Map a tensor (or device) to the implementation family that serves it: "npu", "cuda" or "cpu".

    Device types without a dedicated path (mps, xpu, meta, ...) get the portable "cpu" family, which
    only uses torch ops that every backend implements.
    """
    if isinstance(t, torch.Tensor):
        dev_type = t.device.type
    elif isinstance(t, torch.device):
        dev_type = t.type
    else:
        dev_type = str(t).split(":")[0]
    return dev_type if dev_type in DEVICE_KINDS else "cpu"


def kernel_paths(device_type: str) -> dict[str, str]:
    """Which implementation each op (attention, layer_norm, rms_norm, rope, swiglu) uses on a device.

    ``device_type`` is a device type string such as "npu", "cuda", "cpu" (or "cuda:1"); unknown types
    report the portable path they actually take.
    """
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f"device_type must be a non-empty string like 'npu', 'cuda' or 'cpu', got {device_type!r}")
    return dict(_PATHS[device_kind(device_type)])


def import_torch_npu() -> ModuleType:
    """Import torch_npu on first use in an NPU branch, with an error that says what to install."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise RuntimeError(
            "a tensor is on an 'npu' device but torch_npu cannot be imported; install the 'npu' extra "
            "(torch_npu built for this torch version, on a machine with Ascend CANN)"
        ) from err
