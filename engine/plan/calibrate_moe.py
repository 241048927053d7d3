"""``--calibrate`` for a mixture-of-experts model: what the engine adds to MoE layers, fitted to a
device run's metrics (a metrics.jsonl of engine.train; moe_time.py has the terms):

- ``moe_load_imbalance``: the median ``moe_load_imbalance`` of the run's timed steps (each step's
  most imbalanced MoE layer's max over mean expert load, models/moe/step_figures.py: a layer's
  imbalance is not hidden by another's), when the file has it; the planner applies it to every
  MoE layer, an upper bound where the layers differ;
- the achievable compute fraction: from a dense run of the same active FLOPs
  (``--calibrate-dense METRICS``: the model with each MoE MLP replaced by a dense one K f_e wide,
  which benchmarks/device_check/ runs beside the MoE model), else the cluster's (given by
  ``--achievable-fraction`` or the default);
- ``moe_pass_overhead_s``: the value at which the model predicts the MoE run's measured step
  (bisection; the model's step grows with it), 0 when the run is faster than the model without
  any overhead.

docs/planner.md, "Calibration", says what each fits; tests/engine/plan/test_plan_moe.py checks
that a fitted model predicts the step it was fitted to and that a dense run's fraction carries.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from engine.plan.calibrate import _timed_records, fit_achievable_fraction, measured_step_time
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.timing import estimate

MAX_OVERHEAD_S = 0.1  # per MoE layer and pass: far above any launch overhead


def dense_equivalent(shape: ModelShape) -> ModelShape:
    """The dense model with ``shape``'s active FLOPs: each MoE MLP (K experts of width f_e) as one
    dense MLP of width K f_e. Exact when every layer is an MoE layer without a shared expert."""
    moe = shape.moe
    if moe is None or len(shape.moe_layers) != shape.num_layers or moe.shared_ffn:
        raise ValueError("--calibrate-dense needs an MoE model whose every layer is an MoE layer "
                         "without a shared expert (its dense twin is then one model)")
    return replace(shape, ffn_hidden_size=moe.topk * moe.ffn_hidden, moe=None, moe_layers=())


def measured_imbalance(metrics_path: str) -> float | None:
    """The median ``moe_load_imbalance`` (each step's most imbalanced layer's) of the timed steps,
    or None when the run has none."""
    values = [r["moe_load_imbalance"] for r in _timed_records(metrics_path)
              if isinstance(r.get("moe_load_imbalance"), (int, float))]
    return statistics.median(values) if values else None


def fit_moe_overhead(shape: ModelShape, cluster: Cluster, layout: Layout, step_s: float) -> float:
    """The MoE pass overhead at which the model's step is ``step_s`` (clamped to [0, max])."""
    def step(overhead: float) -> float:
        return estimate(shape, replace(cluster, moe_pass_overhead_s=overhead), layout).step_time_s
    lo, hi = 0.0, MAX_OVERHEAD_S
    if step(lo) >= step_s:
        return lo
    if step(hi) <= step_s:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    return (lo + hi) / 2


def calibrate_moe(shape: ModelShape, cluster: Cluster, layout: Layout, moe_metrics: str,
                  dense_metrics: str | None = None) -> tuple[Cluster, list[str]]:
    """The cluster with the fitted MoE terms (module docstring) and one line per fitted value."""
    notes = []
    imbalance = measured_imbalance(moe_metrics)
    if imbalance is not None:
        cluster = replace(cluster, moe_load_imbalance=max(1.0, imbalance))
        notes.append(f"MoE load imbalance {cluster.moe_load_imbalance:.3f} (median of the run's "
                     f"moe_load_imbalance)")
    if dense_metrics is not None:
        dense = dense_equivalent(shape)
        dense_layout = replace(layout, ep=1, etp=1)
        step = measured_step_time(dense_metrics)
        tflops = estimate(dense, cluster, dense_layout).flops.executed / step / cluster.num_devices / 1e12
        frac = fit_achievable_fraction(dense, cluster, dense_layout, tflops)
        cluster = replace(cluster, achievable_fraction=frac)
        notes.append(f"achievable fraction {frac:.3f} from the dense run of the same active FLOPs "
                     f"(ffn {dense.ffn_hidden_size}; a measured step of {step:.4g} s)")
    step = measured_step_time(moe_metrics)
    overhead = fit_moe_overhead(shape, cluster, layout, step)
    cluster = replace(cluster, moe_pass_overhead_s=overhead)
    limit = " (the fit's upper limit: the model cannot reach the measured step)" \
        if overhead >= MAX_OVERHEAD_S * (1 - 1e-9) else ""
    notes.append(f"MoE overhead {overhead * 1e3:.3f} ms per MoE layer and pass{limit} from a measured "
                 f"step of {step:.4g} s (achievable fraction {cluster.achievable_fraction:.3f})")
    return cluster, notes
