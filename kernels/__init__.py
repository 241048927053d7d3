"""Fused kernels with one dispatch per op: NPU (torch_npu), CUDA and CPU paths, each with a reference
(attention, norms, RoPE, SwiGLU, and the grouped GEMM of mixture-of-experts layers, in bf16 and in
FP8).

Every op picks its path from the input tensor's ``device.type``; ``kernel_paths(device_type)`` says
which implementation runs where. This package imports nothing from engine/, models/ or parallel/.
"""

from kernels.attention import (NpuMaskCache, attention, attention_reference, causal_mask,
                               cu_seqlens_from_document_ids, document_mask)
from kernels.dispatch import ALL_FUSED, OPS, KernelPaths, device_kind, kernel_paths
from kernels.grouped_gemm import (grouped_input_grad, grouped_linear, grouped_linear_reference,
                                  grouped_weight_grad)
from kernels.grouped_experts import grouped_mlp, grouped_mlp_reference
from kernels.fp8_grouped import GroupedFp8Spec, fp8_grouped_linear
from kernels.norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from kernels.rope import (RopeCache, apply_rope, apply_rope_reference, rope_cos_sin, rope_cos_sin_at,
                          rotate_half)
from kernels.swiglu import swiglu, swiglu_packed, swiglu_packed_backward, swiglu_reference

__all__ = [
    "ALL_FUSED",
    "GroupedFp8Spec",
    "KernelPaths",
    "OPS",
    "NpuMaskCache",
    "RopeCache",
    "apply_rope",
    "apply_rope_reference",
    "attention",
    "attention_reference",
    "causal_mask",
    "cu_seqlens_from_document_ids",
    "document_mask",
    "device_kind",
    "fp8_grouped_linear",
    "grouped_input_grad",
    "grouped_linear",
    "grouped_linear_reference",
    "grouped_mlp",
    "grouped_mlp_reference",
    "grouped_weight_grad",
    "kernel_paths",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope_cos_sin",
    "rope_cos_sin_at",
    "rotate_half",
    "swiglu",
    "swiglu_packed",
    "swiglu_packed_backward",
    "swiglu_reference",
]
