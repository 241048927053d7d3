"""FP8 GEMMs: the recipe, quantization to float8 with a given scale, and ``torch._scaled_mm``, one
dispatch per device type, each with its reference.

A recipe (``Fp8Recipe``) names Megatron-LM's ``--fp8-format`` (``e4m3``: every operand e4m3;
``hybrid``: activations and weights e4m3, gradients e5m2) and ``--fp8-recipe`` (``tensorwise``:
one scale per tensor; ``rowwise``: one scale per row of each GEMM operand along the contraction
dimension, rounded down to a power of two as torchao's rowwise recipe does; ``blockwise``: one per
1 x 128 tile and 128 x 128 weight block, e4m3 only, kernels/fp8_blockwise.py). A scale ``s`` maps
a tensor's largest magnitude onto the format's largest finite value: ``s = max_fp8 / amax``
(computed in fp64, kept in fp32, as torchao's ``amax_to_scale``); ``quantize`` stores
``clamp(x * s)`` in float8 (saturating), and a GEMM of two quantized operands multiplies by
``1 / s_a`` and ``1 / s_b`` (the dequantization scales ``torch._scaled_mm`` takes).

``scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)`` calls ``torch._scaled_mm`` where its CUDA
kernels take the operands, and applies the same rules on every device, so the CPU runs the same
choice a GPU makes (torch 2.13's CPU kernel itself accepts any layout and shape):

- ``a`` (M, K) row-major, ``b`` (K, N) column-major (cuBLASLt and the CUTLASS rowwise kernel);
- K and N multiples of 16 (16-byte aligned fp8 rows);
- tensorwise: 0-d fp32 scales, any pair of e4m3 / e5m2 but not e5m2 x e5m2 (cuBLASLt);
- rowwise: ``scale_a`` (M, 1), ``scale_b`` (1, N) fp32, contiguous; ``b`` e4m3, ``a`` e4m3 or
  e5m2 (PyTorch's f8f8bf16_rowwise ``check_inputs``; on sm90 with cuBLAS 12.9 or later torch
  sends rowwise to cuBLASLt instead, which is not stricter), so a gradient always goes first;
  a bf16 output only;
- a bias (ScaledBlas.cpp's ``_scaled_mm_out_cuda``): none with an fp32 output, and in the
  output's dtype (bf16 or fp16). A bias outside that rule is added after the GEMM, in the
  output's dtype (as torchao does), instead of sending the whole GEMM to the reference.

The forward GEMM (``fast_accum``) accumulates with the kernels' fast accumulation, the backward's
two without it: torchao's default for Float8Linear (``Float8GemmConfig(use_fast_accum=True)`` for
the output only). The CPU's kernel ignores the switch.

Outside those rules (an odd width) ``scaled_mm_reference`` runs: the dequantized operands
multiplied in fp32, the definition every path is held to. On CUDA ``quantize`` runs its expression
compiled regionally (one inductor kernel instead of four passes over the tensor, as
kernels/compiled.py does for RoPE and SwiGLU); elsewhere the eager expression.
``torch._scaled_grouped_mm`` (the experts' grouped GEMM, kernels/fp8_grouped.py) is probed per
device type with a tiny call (``scaled_grouped_mm_runs``): torch 2.13 registers it for CUDA only
(and the meta device checks its CUDA rules), so on the CPU the experts run one ``scaled_mm`` per
group. ``Amaxes`` gathers a pass's local amaxes and MAX-reduces them, one all-reduce per group.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.dispatch import device_kind
from kernels.compiled import Regional

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise", "blockwise")
EPS = 1e-12          # the smallest amax a scale is computed from (an all-zero tensor)
ALIGN = 16           # K and N of torch._scaled_mm: multiples of 16 (fp8: 16-byte rows)


@dataclass(frozen=True)
class Fp8Recipe:
    """``--fp8-format`` and ``--fp8-recipe``."""
    format: str = "hybrid"
    recipe: str = "tensorwise"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"--fp8-format must be one of {FORMATS}, got {self.format!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.recipe == "blockwise" and self.format != "e4m3":
            raise ValueError(f"--fp8-recipe blockwise runs every operand in e4m3 (DeepSeek-V3's "
                             f"recipe; PyTorch's blockwise kernel takes e4m3 only), not "
                             f"--fp8-format {self.format}; use --fp8-format e4m3")

    @property
    def forward_dtype(self) -> torch.dtype:
        """Activations and weights."""
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        """Output gradients: e5m2 under hybrid (its range), else e4m3."""
        return E5M2 if self.format == "hybrid" else E4M3

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def blockwise(self) -> bool:
        """1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights
        (kernels/fp8_blockwise.py)."""
        return self.recipe == "blockwise"

    @property
    def power_of_two(self) -> bool:
        """Rowwise (and blockwise) scales are rounded down to a power of two (torchao's rowwise
        recipe)."""
        return self.recipe != "tensorwise"

    def describe(self) -> str:
        return f"fp8 {self.format} {self.recipe}"


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| (fp32; exact): over everything (0-d), or along ``dim`` (kept as size 1)."""
    if dim is None:
        return torch.linalg.vector_norm(x, float("inf")).float()
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True).float()


def amax_to_scale(a: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """The quantization scale of a tensor whose largest magnitude is ``a``: max_fp8 / a in fp64,
    kept in fp32; with ``power_of_two`` rounded down to a power of two."""
    scale = (fp8_max(dtype) / a.double().clamp(min=EPS)).float()
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _quantize(x: torch.Tensor, scale: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


@functools.lru_cache(maxsize=None)   # one compiled function per process
def _compiled_quantize() -> Regional:
    """The quantization compiled regionally (kernels/compiled.py) with dynamic sizes: a model's
    GEMM operands and gradients come in many shapes, which fewer generated kernels serve (a
    two-layer GPT in hybrid FP8: 6 compilations at a run's start instead of 9)."""
    return Regional(_quantize, dynamic=True)


def use_compiled_quantize(x: torch.Tensor) -> bool:
    """On CUDA, outside a compiled graph: the quantization as one generated kernel."""
    return device_kind(x) == "cuda" and not torch.compiler.is_compiling()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             compiled: bool | None = None) -> torch.Tensor:
    """``x * scale`` saturated to ``dtype``'s finite range, stored in ``dtype``; ``scale`` is 0-d
    or broadcasts along the rows or columns of ``x``. ``compiled``: force (True) or forbid (False)
    the compiled expression (None: ``use_compiled_quantize``)."""
    if compiled is None:
        compiled = use_compiled_quantize(x)
    fn = _compiled_quantize() if compiled else _quantize
    return fn(x, scale, fp8_max(dtype), dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values a quantized tensor stands for: q / scale."""
    return q.float() / scale


GROUP_ORDER = {"tp": 0, "cp": 1, "edp": 2}   # groups reduce in this order on every rank


class Amaxes:
    """Local amaxes of one pass, each with the groups it is reduced over: one MAX all-reduce per
    group (TP, then CP, then EDP) over the fp32 concatenation of the entries that name it. A group is the
    engine's ``CommGroup`` (its ``size``, ``kind`` and ``all_reduce``: the backend rules check the
    reduction and the group's byte counter counts it); groups of one rank are left out."""

    def __init__(self):
        self.items: list[tuple[torch.Tensor, tuple]] = []

    def add(self, value: torch.Tensor, groups: tuple) -> int:
        self.items.append((value, tuple(g for g in groups if g is not None and g.size > 1)))
        return len(self.items) - 1

    def reduce(self) -> list[torch.Tensor]:
        values = [v for v, _ in self.items]
        groups: dict = {}
        for _, gs in self.items:
            for g in gs:
                groups.setdefault(id(g), g)
        for group in sorted(groups.values(), key=lambda g: GROUP_ORDER.get(g.kind, 2)):
            mine = [i for i, (_, gs) in enumerate(self.items) if group in gs]
            flat = torch.cat([values[i].reshape(-1) for i in mine])
            group.all_reduce(flat, op=dist.ReduceOp.MAX)
            at = 0
            for i in mine:
                n = values[i].numel()
                values[i] = flat[at:at + n].view(values[i].shape)
                at += n
        return values


def scaled_mm_rules(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor, out_dtype: torch.dtype | None = None,
                    bias: torch.Tensor | None = None) -> str | None:
    """Why ``torch._scaled_mm``'s CUDA kernels would refuse these operands (with ``out_dtype`` and
    ``bias`` when given), or None (module docstring): the rules every device follows here."""
    why = None if bias is None else bias_refusal(bias, out_dtype)
    if why is not None:
        return why
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        return f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}"
    if k % ALIGN or n % ALIGN:
        return f"K={k} and N={n} must be multiples of {ALIGN}"
    if not (a.stride(1) == 1 and a.stride(0) >= k):
        return "a must be row-major"
    if not (b.stride(0) == 1 and b.stride(1) >= k):
        return "b must be column-major"
    rowwise = scale_a.numel() > 1 or scale_b.numel() > 1
    if rowwise:
        if tuple(scale_a.shape) != (m, 1) or tuple(scale_b.shape) != (1, n):
            return f"rowwise scales must be (M, 1) and (1, N), got {tuple(scale_a.shape)}, {tuple(scale_b.shape)}"
        if b.dtype != E4M3:
            return "rowwise: b must be e4m3 (an e5m2 operand goes first)"
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            return "rowwise scales must be contiguous"
        if out_dtype not in (None, torch.bfloat16):
            return f"rowwise: the output must be bf16, got {out_dtype}"
    elif a.dtype == E5M2 and b.dtype == E5M2:
        return "e5m2 x e5m2 is not supported"
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return "scales must be fp32"
    return None


def bias_refusal(bias: torch.Tensor, out_dtype: torch.dtype | None) -> str | None:
    """Why ``torch._scaled_mm``'s CUDA kernel would refuse ``bias`` for ``out_dtype``, or None."""
    if out_dtype == torch.float32:
        return "a bias is not supported with an fp32 output"
    if bias.dtype not in (torch.bfloat16, torch.float16) or bias.dtype != out_dtype:
        return f"the bias must be bf16 or fp16 and the output's dtype, got {bias.dtype} for " \
               f"{out_dtype}"
    return None


def scaled_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) (+ bias) in fp32, cast to ``out_dtype``: the definition."""
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              fast_accum: bool = False) -> torch.Tensor:
    """a (M, K) and b (K, N) float8 with dequantization scales (0-d, or (M, 1) and (1, N)) ->
    (M, N) in ``out_dtype``: ``torch._scaled_mm`` within its rules, else the reference; a bias
    the kernel refuses is added after it. ``fast_accum``: the forward GEMM's accumulation."""
    if scaled_mm_rules(a, b, scale_a, scale_b, out_dtype) is not None:
        return scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias)
    if a.device.type == "cpu" and scale_a.dim() == 0 and scale_b.dim() == 0:
        # torch 2.13's CPU kernel for one scale per tensor takes 25-70 ms a call on CPUs with
        # AMX (its per-row kernel: 0.15 ms); the same scales given per row and column run there
        scale_a = scale_a.expand(a.shape[0], 1).contiguous()
        scale_b = scale_b.expand(1, b.shape[1]).contiguous()
    fused = bias is None or bias_refusal(bias, out_dtype) is None
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias if fused else None,
                           out_dtype=out_dtype, use_fast_accum=fast_accum)
    return out if fused else out + bias.to(out_dtype)


@functools.lru_cache(maxsize=None)   # a fact about the installed torch and the device type
def scaled_grouped_mm_runs(device_type: str) -> bool:
    """Whether the installed torch runs ``torch._scaled_grouped_mm`` on this device type: one
    tiny call, outside any dispatch mode (a FLOP counter, the wait counter: not the caller's work);
    a refusal raises, so nothing is read back."""
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        return False
    from torch.utils._python_dispatch import _disable_current_modes
    try:
        with _disable_current_modes():
            x = torch.zeros(16, 16, device=device_type).to(E4M3)
            w = torch.zeros(1, 16, 16, device=device_type).to(E4M3).transpose(1, 2)
            offs = torch.full((1,), 16, dtype=torch.int32, device=device_type)
            fn(x, w, torch.ones(16, device=device_type), torch.ones(1, 16, device=device_type),
               offs=offs, out_dtype=torch.bfloat16)
        return True
    except Exception:  # noqa: BLE001 - any refusal (no kernel, no device) means no
        return False
