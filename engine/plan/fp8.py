"""FP8 in the planner (``--fp8-format``, docs/precision.md): the rate of the tensor-parallel
linears' GEMMs and the memory of their float8 copies and scales.

Time: under FP8 the linears' GEMMs (QKV, attention output, MLP in and out, the shared expert's; forward
and both backward GEMMs) run at the chip's dense FP8 peak (``DeviceSpec.fp8_tflops``) times the
FP8 achievable fraction (``Cluster.fp8_fraction``: the bf16 fraction until ``--calibrate`` fits it
to an FP8 run). The attention core, the output layer and the MoE router and experts stay at the
bf16 rate, as the engine runs them.

Memory (one TP rank, T = s b / cp tokens per GEMM: under sequence parallelism the column-parallel
input is gathered and the row-parallel output scattered after the GEMM, so every GEMM sees T):

- copies, transient, one GEMM at a time: the largest of a layer's linears (in, out) of
  ``fp8_gemm_copy_bytes``: the weight gradient holds dy and x in float8 and each once more in the
  layout torch._scaled_mm takes (dy^T row-major, x column-major), 2 T (in + out) bytes; the input
  gradient dy, W and W's column-major copy, T out + 2 in out bytes;
- scales kept from forward to backward (parallel/tensor_parallel/fp8.py keeps nothing else: backward
  quantizes again from the saved bf16 tensors), fp32, per layer and micro-batch in flight:
  tensorwise one for x and one per weight of each linear; rowwise at most one per token of x and
  one per output row of W (``fp8_scale_bytes``).
"""
from __future__ import annotations

from engine.plan.model import Cluster, Layout, ModelShape

FP8_BYTES = 1      # a float8 element
SCALE_BYTES = 4    # an fp32 scale


def linear_rate(cluster: Cluster, shape: ModelShape) -> float:
    """FLOP/s of the tensor-parallel linears' GEMMs: FP8 peak x FP8 fraction under FP8, else the
    bf16 peak x the achievable fraction (passes._rates)."""
    if shape.fp8_recipe is None:
        return cluster.peak_tflops * 1e12 * cluster.achievable_fraction
    if cluster.fp8_peak_tflops is None:
        raise ValueError(f"--fp8-format: {cluster.device.name} has no FP8 peak in "
                         f"engine/plan/hardware.py (FP8 needs compute capability 8.9 or later); "
                         f"give --fp8-peak-tflops or drop --fp8-format")
    return cluster.fp8_peak_tflops * 1e12 * cluster.fp8_fraction


def layer_linears(shape: ModelShape, tp: int) -> list[tuple[float, float, int]]:
    """(in, out, weights) of each tensor-parallel linear call of a layer on one TP rank: QKV,
    attention output, MLP in (llama: gate and up, two weights on one input), MLP out."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_hidden
    gated = shape.block == "llama"
    return [(h, (h + 2 * kv) / tp, 1), (h / tp, h, 1), (h, (2 if gated else 1) * f / tp, 2 if gated else 1),
            (f / tp, h, 1)]


def _tokens(shape: ModelShape, layout: Layout) -> float:
    return shape.seq_length * layout.micro_batch_size / layout.cp


def fp8_gemm_copy_bytes(shape: ModelShape, layout: Layout) -> float:
    """The float8 copies alive during a layer's largest FP8 GEMM (transient; module docstring)."""
    if shape.fp8_recipe is None:
        return 0.0
    T = _tokens(shape, layout)
    return FP8_BYTES * max(max(2 * T * (i + o), T * o + 2 * i * o)
                           for i, o, _ in layer_linears(shape, layout.tp))


def fp8_scale_bytes(shape: ModelShape, layout: Layout) -> float:
    """fp32 scales one layer keeps per micro-batch from forward to backward."""
    if shape.fp8_recipe is None:
        return 0.0
    linears = layer_linears(shape, layout.tp)
    if shape.fp8_recipe == "tensorwise":
        return SCALE_BYTES * sum(1 + n for _, _, n in linears)
    T = _tokens(shape, layout)
    return SCALE_BYTES * sum(T + o for _, o, _ in linears)
