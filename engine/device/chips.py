"""Ascend chip capabilities, as data: which generation a device name belongs to, which fused
torch_npu ops its documentation supports there, and how the chip reports a float overflow.

Pure Python (no torch_npu): the device module (engine/device/runtime.py) reads the chip's name with
``torch_npu.npu.get_device_name`` and hands it to ``npu_kernel_paths`` and ``overflow_mode``; the
choice travels down to the kernels as a ``kernels.dispatch.KernelPaths`` (nothing below the engine
reads a chip name). Peaks and memory per SKU are in ``engine/plan/hardware.py``; docs/hardware.md
joins the two tables.

Device names (torch_npu ``get_device_name``, the SoC names of torch_npu's ``SocVersion`` enum and of
the CANN runtime), by product generation:

=================  ==========================================  ====================================
generation         names                                       product
=================  ==========================================  ====================================
atlas-training     Ascend910A, Ascend910ProA, Ascend910PremiumA, Atlas training series (Ascend 910)
                   Ascend910ProB, Ascend910B (no digit: the
                   first-generation SoC 104, not a 910B1-B4)
atlas-a2           Ascend910B1, B2, B2C, B3, B4, B4-1           Atlas A2 training series (910B)
atlas-a3           Ascend910_9391, _9381, _9372, _9392, _9382,  Atlas A3 training series (910C)
                   _9362
ascend950          Ascend950PR_*, Ascend950DT_*                 Ascend 950 (Atlas 350)
=================  ==========================================  ====================================

Fused ops per generation (a generation missing from a row runs the portable reference path, with
one note at start-up):

- ``npu_fusion_attention`` (FlashAttentionScore): Atlas A2 training series in the op-plugin API
  page (docs/context/torch_npu-npu_fusion_attention.md); A2 and A3 in Ascend Extension for PyTorch
  6.0.0, "FlashAttentionScore" (ptmoddevg/trainingmigrguide/performance_tuning_0027); 950PR/950DT,
  A3 and A2 training in CANN ops-transformer attention/flash_attention_score/README.md. Not the
  Atlas training series.
- ``npu_swiglu``: Atlas A2 training series (op-plugin and torch_npu 6.0/7.x API pages), A2 and A3
  ("SwiGlu", Ascend Extension for PyTorch 7.3.0 performance_tuning_0035). Nothing published for the
  Atlas training series or the 950.
- ``npu_rms_norm``: Atlas training, A2 and A3 training series (Ascend Extension for PyTorch 6.0.0 and
  7.0.0 API reference, "torch_npu.npu_rms_norm").
- ``npu_rotary_mul``: Atlas training, A2 and A3 training series (op-plugin 7.3.0
  docs/context/torch_npu-npu_rotary_mul.md).
- ``npu_grouped_matmul`` (the MoE experts' grouped GEMM, kernels/grouped_gemm.py): A2 and A3
  training series, and the Atlas inference series, which is not a training chip here (op-plugin
  7.3.0 docs/context/torch_npu-npu_grouped_matmul.md, "产品支持情况"). Not the Atlas training
  series; nothing published for the 950.

Float overflow (CANN runtime, ``aclrtFloatOverflowMode``; TF adapter ``set_device_sat_mode``; CANN
environment variable ``INF_NAN_MODE_ENABLE``): the Atlas training series supports only the
saturation mode (an overflow becomes +-MAX, a NaN becomes 0, so ``isfinite`` never fires); A2 and A3
default to the IEEE Inf/NaN mode and can be switched to saturation (``INF_NAN_MODE_ENABLE=0``);
the 950 supports only Inf/NaN. On a saturation-mode chip the overflow check reads the float status
register instead (``torch_npu.npu_clear_float_status`` / ``npu_get_float_status``, documented for
the Atlas training, A2 and A3 series), see engine/device/runtime.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from kernels.dispatch import KernelPaths


@dataclass(frozen=True)
class Generation:
    key: str
    product: str
    patterns: tuple[str, ...]     # regexes on the lower-cased name with spaces, '-' and '_' removed
    overflow: str                 # default mode: "saturation" or "inf_nan"
    saturation_only: bool = False
    inf_nan_only: bool = False
    bf16: bool = True             # bfloat16 arithmetic (torch_npu's IsBF16Supported: Ascend910B1 on)


GENERATIONS = (
    Generation("atlas-a2", "Atlas A2 training series", (r"^ascend910b[1-4]",), "inf_nan"),
    Generation("atlas-a3", "Atlas A3 training series", (r"^ascend9109[0-9]{3}$",), "inf_nan"),
    Generation("ascend950", "Ascend 950 (Atlas 350)", (r"^ascend950",), "inf_nan", inf_nan_only=True),
    Generation("atlas-training", "Atlas training series", (r"^ascend910(a|proa|premiuma|prob|b)?$",),
               "saturation", saturation_only=True, bf16=False),
)

# op (a KernelPaths field) -> generations whose documentation lists it; sources in the docstring
FUSED_OPS = MappingProxyType({
    "fusion_attention": frozenset({"atlas-a2", "atlas-a3", "ascend950"}),
    "swiglu": frozenset({"atlas-a2", "atlas-a3"}),
    "rms_norm": frozenset({"atlas-training", "atlas-a2", "atlas-a3"}),
    "rotary_mul": frozenset({"atlas-training", "atlas-a2", "atlas-a3"}),
    "grouped_matmul": frozenset({"atlas-a2", "atlas-a3"}),
})
TORCH_NPU_OPS = MappingProxyType({"fusion_attention": "npu_fusion_attention", "swiglu": "npu_swiglu",
                                  "rms_norm": "npu_rms_norm", "rotary_mul": "npu_rotary_mul",
                                  "grouped_matmul": "npu_grouped_matmul"})
OVERFLOW_MODES = ("saturation", "inf_nan")

# --tp-comm-overlap's fused communication-compute (MC2) ops: generation -> the TP sizes its
# documentation gives (op-plugin 7.3.0 docs/context/torch_npu-npu_all_gather_base_mm.md and
# torch_npu-npu_mm_reduce_scatter_base.md: A2 2/4/8 ranks on an HCCS full mesh, A3 2-32 on a double
# ring; fp16/bf16, 2-D operands, k in [256, 65535), m divisible by the world size, no bias). The
# trainer turns the fused ops on only where this table lists them (``tp_overlap_mode``): the TP
# size is this table's decision. Per call the layers' path (parallel/tensor_parallel/
# overlap_fused.py ``NpuMc2Path``) checks dtype and k (and, as a safety bound, a size some
# generation documents); a call outside them (fp32, or k < 256, e.g. a backward's) runs the
# chunked ring, which overlaps too. Not yet run on a chip.
TP_OVERLAP_OPS = MappingProxyType({
    op: MappingProxyType({"atlas-a2": (2, 4, 8), "atlas-a3": (2, 4, 8, 16, 32)})
    for op in ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base")})
# without sequence parallelism: the row-parallel GEMM and its all-reduce (op-plugin 7.3.0
# docs/context/torch_npu-npu_mm_all_reduce_base.md lists Atlas A2 only; fp16/bf16, x1 2-D or 3-D,
# x2 2-D; the MC2 family's 2/4/8 ranks and k range). Not yet run on a chip.
TP_OVERLAP_ALL_REDUCE = MappingProxyType({"npu_mm_all_reduce_base": MappingProxyType({"atlas-a2": (2, 4, 8)})})


def tp_overlap_fused(device_name: str, tp: int) -> bool:
    """Whether both fused TP-overlap ops are documented for this chip at this TP size.

    >>> tp_overlap_fused("Ascend910B3", 8), tp_overlap_fused("Ascend910_9392", 16), tp_overlap_fused("Ascend910A", 2)
    (True, True, False)
    """
    gen = generation_of(device_name)
    return gen is not None and all(tp in sizes.get(gen.key, ()) for sizes in TP_OVERLAP_OPS.values())


def tp_overlap_all_reduce_fused(device_name: str, tp: int) -> bool:
    """Whether the fused matmul-all-reduce (no sequence parallelism) is documented here.

    >>> tp_overlap_all_reduce_fused("Ascend910B3", 8), tp_overlap_all_reduce_fused("Ascend910_9392", 8)
    (True, False)
    """
    gen = generation_of(device_name)
    sizes = TP_OVERLAP_ALL_REDUCE["npu_mm_all_reduce_base"]
    return gen is not None and tp in sizes.get(gen.key, ())


def tp_overlap_mode(device_type: str, device_name: str, tp: int, sequence_parallel: bool) -> str:
    """The layers' --tp-comm-overlap mode on this device: "auto" (the fused ops where the layers'
    probe finds them, else the ring) or "ring" (never a fused op). On an Ascend chip "auto" only
    where its documentation lists the ops this layout uses at this TP size (with sequence
    parallelism the gather/scatter pair, without it the matmul-all-reduce); elsewhere "auto".

    >>> tp_overlap_mode("npu", "Ascend910_9392", 8, True), tp_overlap_mode("npu", "Ascend910_9392", 8, False)
    ('auto', 'ring')
    >>> tp_overlap_mode("npu", "Ascend910A", 2, True), tp_overlap_mode("cuda", "NVIDIA H200", 8, True)
    ('ring', 'auto')
    """
    if device_type != "npu":
        return "auto"
    documented = tp_overlap_fused if sequence_parallel else tp_overlap_all_reduce_fused
    return "auto" if documented(device_name, tp) else "ring"


def _normalise(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.strip().lower())


def generation_of(device_name: str) -> Generation | None:
    """The generation of an Ascend device name, or None (not an Ascend training chip we know).

    >>> [generation_of(n).key for n in ("Ascend910B2", "Ascend910_9392", "Ascend910ProB", "Ascend950PR_9589")]
    ['atlas-a2', 'atlas-a3', 'atlas-training', 'ascend950']
    """
    key = _normalise(device_name)
    for gen in GENERATIONS:
        if any(re.search(p, key) for p in gen.patterns):
            return gen
    return None


def npu_kernel_paths(device_name: str) -> tuple[KernelPaths, list[str]]:
    """The fused ops an NPU of this name runs, and one note per op it does not (reference path).

    >>> paths, notes = npu_kernel_paths("Ascend910A")
    >>> paths.fusion_attention, paths.swiglu, paths.rms_norm, paths.rotary_mul, len(notes)
    (False, False, True, True, 3)
    >>> npu_kernel_paths("Ascend910B3")[0].grouped_matmul, npu_kernel_paths("Ascend910A")[0].grouped_matmul
    (True, False)
    """
    gen = generation_of(device_name)
    flags, notes = {}, []
    if gen is not None and gen.key == "atlas-training":
        flags["rotary_table"] = "atlas-training"  # kernels/rope.py: its own shape table
    for op, gens in FUSED_OPS.items():
        flags[op] = gen is not None and gen.key in gens
        if not flags[op]:
            where = f"{gen.product} ({device_name})" if gen else f"unknown NPU {device_name!r}"
            notes.append(f"torch_npu.{TORCH_NPU_OPS[op]} is not documented for {where}: "
                         f"{op.replace('_', ' ')} runs the portable reference path")
    return KernelPaths(**flags), notes


def overflow_mode(device_name: str, runtime_inf_nan: bool | None = None) -> str:
    """How this chip reports float overflow: "saturation" (read the float status register) or
    "inf_nan" (gradients hold inf/nan, ``isfinite`` works).

    ``runtime_inf_nan`` is what ``torch_npu.npu.utils.is_support_inf_nan()`` said (None: not asked);
    it decides where the chip supports both modes (A2, A3 with ``INF_NAN_MODE_ENABLE``); a chip with
    only one mode has that one. An unknown chip follows the runtime, else saturation (the safe
    choice: the status register also catches an overflow that did produce inf).

    >>> overflow_mode("Ascend910A"), overflow_mode("Ascend910B3"), overflow_mode("Ascend910B3", False)
    ('saturation', 'inf_nan', 'saturation')
    """
    gen = generation_of(device_name)
    if gen is not None and gen.saturation_only:
        return "saturation"
    if gen is not None and gen.inf_nan_only:
        return "inf_nan"
    if runtime_inf_nan is not None:
        return "inf_nan" if runtime_inf_nan else "saturation"
    return gen.overflow if gen is not None else "saturation"


def precision_problem(device_name: str, precision: str) -> str | None:
    """Why ``--precision`` cannot run on this NPU (one line naming the chip and what to use), or None.

    The Atlas training series (Ascend 910A, 910ProB, ...) has no bfloat16 arithmetic (torch_npu's
    ``IsBF16Supported`` holds from Ascend910B1 on); fp16 with the loss scaler is its mixed precision.

    >>> precision_problem("Ascend910B3", "bf16") is None, precision_problem("Ascend910A", "fp16") is None
    (True, True)
    >>> precision_problem("Ascend910ProB", "bf16").split(":")[0]
    '--precision bf16 needs bfloat16 arithmetic, which Ascend910ProB (Atlas training series) does not have'
    """
    gen = generation_of(device_name)
    if precision == "bf16" and gen is not None and not gen.bf16:
        return (f"--precision bf16 needs bfloat16 arithmetic, which {device_name} ({gen.product}) does "
                f"not have: use --precision fp16 (the dynamic loss scaler keeps it stable) or fp32")
    return None


# FP8 (``--fp8-format``, docs/precision.md): FP8 tensor cores, NVIDIA compute capability 8.9 and
# later (CUDA's torch._scaled_mm refuses anything older). Device names as ``torch.cuda.
# get_device_name`` gives them, lower-cased without spaces, '-' or '_' and without "nvidia";
# first match wins. A GPU this table does not list stops at start: its FP8 support is unknown here.
GPU_GENERATIONS = (
    (r"gh200|h200|h100|h800|h20$", "Hopper", (9, 0)),
    (r"gb200|gb300|b200|b300|b100", "Blackwell", (10, 0)),
    (r"rtx50[0-9]0|rtxpro[0-9]+blackwell", "Blackwell (GeForce / RTX PRO)", (12, 0)),
    (r"l40s|l40|l4$|l20|rtx40[0-9]0|rtx[0-9]+adageneration|rtx[0-9]+ada", "Ada Lovelace", (8, 9)),
    (r"a100|a800|a30$", "Ampere (A100 class)", (8, 0)),
    (r"a10$|a10g|a40$|a16$|a2$|rtxa[0-9]+|rtx30[0-9]0", "Ampere", (8, 6)),
    (r"v100|titanv", "Volta", (7, 0)),
    (r"t4$|rtx20[0-9]0|quadrortx", "Turing", (7, 5)),
)
FP8_CAPABILITY = (8, 9)
# Ascend: no FP8 on the Atlas training, A2 and A3 series; the 950's HiF8 (Huawei's own 8-bit
# float, not e4m3 / e5m2) has no path here yet.
NPU_FP8 = MappingProxyType({
    "atlas-training": "has no FP8 arithmetic",
    "atlas-a2": "has no FP8 arithmetic",
    "atlas-a3": "has no FP8 arithmetic",
    "ascend950": "computes in HiF8, Huawei's 8-bit float, which gridtron does not support yet "
                 "(its FP8 path is e4m3 / e5m2 through torch._scaled_mm)",
})


def gpu_generation(device_name: str) -> tuple[str, tuple[int, int]] | None:
    """(generation, compute capability) of an NVIDIA device name, or None (not in the table).

    >>> gpu_generation("NVIDIA H200"), gpu_generation("NVIDIA A100-SXM4-80GB")[1]
    (('Hopper', (9, 0)), (8, 0))
    >>> gpu_generation("NVIDIA L40S")[0], gpu_generation("Tesla T4")[0], gpu_generation("NVIDIA X1")
    ('Ada Lovelace', 'Turing', None)
    """
    key = re.sub(r"^(nvidia|tesla)", "", _normalise(device_name))
    for pattern, generation, capability in GPU_GENERATIONS:
        if re.search(pattern, key):
            return generation, capability
    return None


def fp8_problem(device_type: str, device_name: str,
                capability: tuple[int, int] | None = None) -> str | None:
    """Why ``--fp8-format`` cannot run on this device (one line naming the chip), or None.

    The CPU runs torch._scaled_mm (torch 2.13); a GPU needs compute capability 8.9 or later, read
    from the table above (and, when the runtime reports one, from the device itself); an Ascend
    chip has no FP8 path here.

    >>> fp8_problem("cpu", "cpu") is None, fp8_problem("cuda", "NVIDIA H100 80GB HBM3") is None
    (True, True)
    >>> fp8_problem("cuda", "NVIDIA A100-SXM4-80GB").split(";")[0]
    '--fp8-format needs FP8 tensor cores (compute capability 8.9 or later: H100, H200, Ada, Blackwell), and NVIDIA A100-SXM4-80GB (Ampere (A100 class)) has compute capability 8.0'
    >>> fp8_problem("npu", "Ascend910B3").split(";")[0]
    '--fp8-format: Ascend910B3 (Atlas A2 training series) has no FP8 arithmetic'
    """
    if device_type == "cpu":
        return None
    drop = "; drop --fp8-format (bf16 is the fastest precision there)"
    if device_type == "npu":
        gen = generation_of(device_name)
        if gen is None:
            return (f"--fp8-format: the NPU {device_name!r} is not in the chip table "
                    f"(engine/device/chips.py), so its FP8 support is unknown; drop --fp8-format")
        return f"--fp8-format: {device_name} ({gen.product}) {NPU_FP8[gen.key]}{drop}"
    if device_type != "cuda":
        return f"--fp8-format runs on CUDA GPUs and the CPU, not on {device_type} devices; drop it"
    need = "--fp8-format needs FP8 tensor cores (compute capability 8.9 or later: H100, H200, Ada, Blackwell)"
    found = gpu_generation(device_name)
    if found is None:
        return (f"{need}, and {device_name!r} is not in the chip table (engine/device/chips.py), "
                f"so its FP8 support is unknown; add it there, or drop --fp8-format")
    generation, table_cc = found
    cc = capability or table_cc
    if min(cc, table_cc) < FP8_CAPABILITY:
        low = min(cc, table_cc)
        return f"{need}, and {device_name} ({generation}) has compute capability {low[0]}.{low[1]}{drop}"
    return None


COMPILE_ON_NPU = ("--compile on NPU: torch_npu's torch.compile backend (TorchAir) is documented for "
                  "inference graphs only (TorchAir user guide, 'product positioning'), so a training "
                  "graph with npu_fusion_attention's backward has no documented graph mode; run "
                  "without --compile (the fused NPU kernels already run in eager mode)")


def npu_start_problem(device_name: str, precision: str, compile: bool) -> str | None:
    """The first reason this NPU run cannot start as configured (one line), or None.

    >>> npu_start_problem("Ascend910B3", "bf16", compile=False) is None
    True
    >>> npu_start_problem("Ascend910B3", "bf16", compile=True).split(":")[0]
    '--compile on NPU'
    """
    if compile:
        return COMPILE_ON_NPU
    return precision_problem(device_name, precision)
