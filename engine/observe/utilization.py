"""What a run's MFU and HFU divide: the step's FLOPs (model and executed) and the dense peak.

- ``mfu`` = model FLOPs of a step (no recomputation) / step time / devices / dense peak
  (``model_tflops_per_device`` before the division by the peak);
- ``hfu`` = executed FLOPs (recomputation included) over the same time and peak
  (``tflops_per_device``, the figure Megatron-LM and the planner report).

The FLOPs come from ``engine.plan.flops.step_flops`` for the blocks it has a formula for (gpt2,
llama). A block without one (a user's class, or a built-in subclass that changes ``forward``) is
measured instead: every layer's block (``block_cls(cfg, i, ...)`` for each global index i, since a
block may differ by layer) is built on the meta device (no memory, no initialisation cost) and its
forward on one (1, s, h) sequence runs under ``torch.utils.flop_counter``, which counts the same
operations the formulas do (matrix multiplies and attention, 2 FLOPs per multiply-add). The model
count is then ``3 x`` the layers' summed forward per sequence (backward = twice the forward, the
formulas' convention) plus the logit layer; on the built-in blocks this equals the formula exactly
(tests/engine/observe/test_utilization.py). What recomputation re-runs inside a user's block is not known, so with
``--recompute`` a measured block has no executed count (``tflops_per_device`` and ``hfu`` null). If the measurement fails too,
``mfu`` and ``hfu`` are null and a warning says why, once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from engine.plan.flops import (achieved_tflops, attention_core_step_flops, count_flops,
                               formula_block, logits_forward_flops, moe_shape,
                               recompute_stops_early, step_flops)
from engine.plan.flops import utilization as plan_utilization
from engine.plan.hardware import peak_tflops


@dataclass(frozen=True)
class RunFlops:
    model: float | None      # per optimizer step; None: unknown
    executed: float | None
    source: str              # "formula gpt2", "flop_counter", or why there is no count
    # the fewest a step can run: executed (model where unknown) with the attention core's Q K^T
    # and scores x V at half, as a causal kernel that skips the masked half runs them
    least: float | None = None


def block_forward_flops(block_cls, cfg, attention: list | None = None, layer_idx: int = 0) -> float:
    """FLOPs of layer ``layer_idx``'s block forward over one sequence of ``cfg.seq_length``,
    counted on meta; ``attention``: a list that gets the attention kernels' part of them appended."""
    from models.layers import LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    ctx = LayerContext(Initializer(0, cfg.init_std))
    with torch.device("meta"):
        block = block_cls(cfg, layer_idx, ParallelState.serial("meta"), ctx).eval()
    x = torch.zeros(1, cfg.seq_length, cfg.hidden_size, device="meta")
    with torch.no_grad():
        return count_flops(block, x, attention=attention)[1]


def run_flops(cfg, block_cls, recompute: str, global_batch: int,
              routed_tokens: int | None = None, padded_vocab: int | None = None) -> RunFlops:
    """Model and executed FLOPs of one optimizer step of the run (see the module docstring);
    ``routed_tokens``: the tokens an MoE layer routes per forward (engine.plan.flops);
    ``padded_vocab``: the output layer's columns as allocated (a multiple of 128 x tp), whose
    zero columns the executed count includes and the model count does not."""
    m = cfg
    name = formula_block(block_cls)
    if name is not None:
        f = step_flops(global_batch, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size,
                       ffn_hidden=m.ffn_hidden_size, block=name, recompute=recompute,
                       recompute_early_stop=recompute_stops_early(m.dropout),
                       kv_hidden=m.kv_hidden_size, moe=moe_shape(m), routed_tokens=routed_tokens,
                       padded_vocab=padded_vocab)
        core = attention_core_step_flops(global_batch, m.seq_length, m.num_layers, m.hidden_size,
                                         recompute)
        return RunFlops(f.model, f.executed, f"formula {name}", f.executed - core / 2)
    label = f"{block_cls.__module__}.{block_cls.__qualname__}"
    attention = []
    try:
        per_sequence = sum(block_forward_flops(block_cls, m, attention, i)  # all layers
                           for i in range(m.num_layers))
    except Exception as exc:  # noqa: BLE001 - any failure of a user's block means "unknown"
        warnings.warn(f"block {label} has no FLOPs formula and could not be measured on the meta "
                      f"device ({type(exc).__name__}: {exc}): tflops_per_device, mfu and hfu are "
                      f"null for this run")
        return RunFlops(None, None, f"none ({type(exc).__name__})")
    tokens = global_batch * m.seq_length
    model = 3 * (global_batch * per_sequence
                 + logits_forward_flops(tokens, m.hidden_size, m.vocab_size))
    columns = 3 * logits_forward_flops(tokens, m.hidden_size, (padded_vocab or m.vocab_size)
                                       - m.vocab_size)
    executed = model + columns if recompute == "none" else None
    least = model - 3 * global_batch * sum(attention) / 2  # forward x 3, as model
    note = "" if executed is not None else (f"; with --recompute {recompute} what the block "
                                            f"recomputes is unknown, so tflops_per_device and "
                                            f"hfu are null")
    warnings.warn(f"block {label} has no FLOPs formula: its FLOPs are counted with "
                  f"torch.utils.flop_counter on one sequence per layer (forward x 3){note}")
    return RunFlops(model, executed, "flop_counter", least)


def tf32_enabled(kind: str) -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores (CUDA: float32 matmul precision below
    "highest"); fp32 peaks then are the TF32 ones."""
    return kind == "cuda" and torch.get_float32_matmul_precision() != "highest"


def run_peak(dev, precision: str, given: float | None,
             tf32: bool | None = None) -> tuple[float | None, str]:
    """The dense peak MFU/HFU divide by and where it comes from, in words for the run's summary:
    ``--peak-tflops``, else the table's for this device and precision (``tf32``: fp32 matmuls on
    TF32/HF32 units, as ``engine.device.runtime.set_matmul_precision`` set them; None reads CUDA's
    setting), else (CPU) a one-time matmul measurement; None when no figure is known."""
    if given:
        return given, "--peak-tflops"
    peak = peak_tflops(dev.name, precision, tf32_enabled(dev.type) if tf32 is None else tf32)
    if peak is not None:
        return peak, f"the hardware table, {dev.name} in {precision}"
    if dev.type == "cpu":
        from engine.device.runtime import measure_cpu_peak_tflops
        return measure_cpu_peak_tflops(), "measured at start by a matmul: moves with the machine's load"
    return None, "none known"


def run_peak_tflops(dev, precision: str, given: float | None, tf32: bool | None = None) -> float | None:
    """``run_peak``'s figure alone."""
    return run_peak(dev, precision, given, tf32)[0]


def per_device(flops: float | None, seconds: float, devices: int) -> float | None:
    """TFLOP/s per device (``engine.plan.flops.achieved_tflops``), None when the FLOPs are unknown."""
    if flops is None or seconds <= 0:
        return None
    return achieved_tflops(flops, seconds, devices)


def utilization(tflops: float | None, peak: float | None) -> float | None:
    """``engine.plan.flops.utilization``, None also when the achieved figure is unknown."""
    return None if tflops is None else plan_utilization(tflops, peak)
