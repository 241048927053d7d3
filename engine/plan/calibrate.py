"""Calibration: the planner's fitted constants from a measured run (``--calibrate``) and link
bandwidths from a preflight measurement (``--calibrate-links``).

- ``fit_achievable_fraction``: the compute fraction at which the model predicts a measured step
  (of an FP8 run: the FP8 GEMMs' fraction, ``key="fp8_achievable_fraction"``, the bf16 one held);
- ``fit_overlap_efficiency``: the overlap efficiencies (hardware.OverlapEfficiency) at which the
  model's exposed TP and DP communication equals the run's ``time_tp_exposed_s`` and
  ``time_dp_exposed_s`` (engine metrics, device time the compute stream waited);
- ``fit_host_update_gbps``: with ``--optimizer-cpu-offload``, the rate the host's AdamW reaches
  (``Cluster.host_update_gbps``) from the run's ``time_optimizer_s`` (``measured_optimizer_time``);
- ``link_busbw``: intra- and inter-node bus bandwidths from the preflight's JSON.

docs/planner.md, "Calibration", says what each fits and from which figures.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

from engine.plan.hardware import OverlapEfficiency
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.timing import estimate


def _step_time(record: dict, metrics_path: str, number: int) -> float | None:
    """A record's ``step_time_s``: None where the run left it out (null or missing), else a finite
    number above 0; anything else is an error naming the file and the line."""
    value = record.get("step_time_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"--calibrate {metrics_path}: line {number} has step_time_s {value!r}; "
                         f"a step time is a finite number of seconds above 0: give the "
                         f"metrics.jsonl of a run")
    return value


def _run_starts(records: list[dict]) -> list[bool]:
    """Whether each record is the first (warm-up) step of a process: marked ``warmup`` (the
    trainer marks each process's first step, so a run resumed at step k, whose records follow
    steps 1..k of the file (engine/observe/metrics.py), has its step k + 1 marked), and in files
    without the mark the file's first, a step 1, and a step that does not follow the record
    before it (a run's records appended after another run's records that go on past its start).
    The records without a whole ``step`` continue the run before them."""
    starts, previous = [], None
    for i, record in enumerate(records):
        step = record.get("step")
        whole = isinstance(step, int) and not isinstance(step, bool)
        starts.append(i == 0 or record.get("warmup") is True
                      or (whole and (step == 1 or (previous is not None
                                                   and step != previous + 1))))
        previous = step if whole else None
    return starts


def _timed_records(metrics_path: str) -> list[dict]:
    """The records of a metrics JSONL with a step time, without each run's first (warm-up) step
    (``_run_starts``) and skipped steps (all timed ones when nothing else is left)."""
    records = []
    with open(metrics_path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"--calibrate {metrics_path}: line {number} is not JSON ({exc}); "
                                 f"give the metrics.jsonl of a run") from exc
            if not isinstance(record, dict):
                raise ValueError(f"--calibrate {metrics_path}: line {number} is not a JSON object; "
                                 f"expected one JSON object per line")
            records.append((record, _step_time(record, metrics_path, number)))
    starts = _run_starts([r for r, _ in records])
    timed = [r for (r, t), start in zip(records, starts)
             if not start and not r.get("skipped") and t is not None]
    records = timed or [r for r, t in records if t is not None]
    if not records:
        raise ValueError(f"--calibrate {metrics_path}: no step with step_time_s")
    return records


def measured_step_time(metrics_path: str) -> float:
    """Median step_time_s of a metrics JSONL, without the first (warm-up) step and skipped steps.

    Step time is the one measured figure whose meaning does not depend on how the trainer counts
    FLOPs (model or executed); the fit compares it with the planner's own step time.
    """
    return statistics.median(r["step_time_s"] for r in _timed_records(metrics_path))


def measured_exposed(metrics_path: str) -> dict[str, float]:
    """Median ``time_tp_exposed_s`` and ``time_dp_exposed_s`` (device time the compute stream
    waited on TP and on DP communication) of the same steps, where the run reported them (a null
    or missing key is left out)."""
    records = _timed_records(metrics_path)
    out = {}
    for key in ("time_tp_exposed_s", "time_dp_exposed_s"):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
    return out


def measured_optimizer_time(metrics_path: str) -> float | None:
    """Median ``time_optimizer_s`` (the update, engine/training/step.py) of the same steps, None
    where the run did not report it."""
    values = [r["time_optimizer_s"] for r in _timed_records(metrics_path)
              if isinstance(r.get("time_optimizer_s"), (int, float))]
    return statistics.median(values) if values else None


def fit_host_update_gbps(shape: ModelShape, cluster: Cluster, layout: Layout,
                         optimizer_s: float) -> float:
    """The host AdamW's rate (GB/s) at which the model's update of an offloaded run takes the
    measured ``optimizer_s``: the host's bytes over what the measurement leaves after the device's
    own part of the update (offload.py; the copies up, beside the host update, are left out)."""
    from engine.plan.offload import host_update_s, most_offloaded
    if not layout.offload:
        raise ValueError("--calibrate: the host update's rate is fitted from an offloaded run "
                         "(--optimizer-cpu-offload); this layout offloads nothing")
    at_one = host_update_s(shape, replace(cluster, host_update_gbps=1.0), most_offloaded(shape, layout))
    device = estimate(shape, cluster, layout).time.optimizer
    left = optimizer_s - device
    if left <= 0:
        raise ValueError(f"--calibrate: the run's time_optimizer_s {optimizer_s:.4g} s is no more "
                         f"than the device's own update ({device:.4g} s): no host time to fit")
    return at_one / left


def _bisect_efficiency(exposed, measured: float) -> float:
    """The efficiency in [0, 1] at which ``exposed(e)`` (not increasing in e) equals ``measured``."""
    lo, hi = 0.0, 1.0
    if exposed(hi) >= measured:
        return hi
    if exposed(lo) <= measured:
        return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if exposed(mid) < measured else (mid, hi)
    return (lo + hi) / 2


def fit_overlap_efficiency(shape: ModelShape, cluster: Cluster, layout: Layout,
                           measured: dict[str, float]) -> OverlapEfficiency:
    """The overlap efficiencies at which the model's exposed communication equals a measured
    run's: ``tp`` from ``time_tp_exposed_s`` against ``tp_comm`` (only with --tp-comm-overlap and
    sequence parallelism, where it has a meaning), then ``dp`` and ``zero`` together (one value)
    from ``time_dp_exposed_s`` against ``dp_comm + zero_allgather``. A figure the run did not report,
    or that the layout cannot tell, keeps the cluster's value."""
    eff = cluster.overlap
    run = lambda e: estimate(shape, replace(cluster, overlap=e), layout).time  # noqa: E731
    if "time_tp_exposed_s" in measured and layout.tp_comm_overlap and layout.sequence_parallel \
            and layout.tp > 1:
        tp = _bisect_efficiency(lambda e: run(replace(eff, tp=e)).tp_comm, measured["time_tp_exposed_s"])
        eff = replace(eff, tp=tp)
    if "time_dp_exposed_s" in measured and layout.dp * layout.cp > 1 and (
            layout.overlap_grad_reduce or (layout.zero and layout.overlap_param_gather)):
        both = lambda e: run(replace(eff, dp=e, zero=e))  # noqa: E731
        dp = _bisect_efficiency(lambda e: both(e).dp_comm + both(e).zero_allgather,
                                measured["time_dp_exposed_s"])
        eff = replace(eff, dp=dp, zero=dp)
    return eff


def fit_achievable_fraction(shape: ModelShape, cluster: Cluster, layout: Layout, tflops: float,
                            key: str = "achievable_fraction") -> float:
    """The achievable fraction at which the model predicts ``tflops`` executed TFLOP/s per device
    (bisection; for a measured step time pass executed FLOPs / step time / devices). ``key``: the
    Cluster field fitted (``fp8_achievable_fraction``: the FP8 GEMMs' of an FP8 run).

    Predicted TFLOP/s grows monotonically with the fraction; a measurement above the prediction at
    fraction 1 (links or HBM faster than assumed) returns 1.0.
    """
    def predicted(frac: float) -> float:
        return estimate(shape, replace(cluster, **{key: frac}), layout).tflops_per_device
    lo, hi = 1e-4, 1.0
    if predicted(hi) <= tflops:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < tflops else (lo, mid)
    return (lo + hi) / 2


_INTRA_GROUPS = ("tp", "intra", "node", "intra_node")
_INTER_GROUPS = ("dp", "pp", "inter", "inter_node", "world", "global")


def link_busbw(preflight_path: str) -> dict[str, float]:
    """{'intra': GB/s, 'inter': GB/s} from a preflight JSON list of {op, group, bytes, busbw_gbps}.

    For each link class the entries with the largest message size (the bandwidth-bound regime)
    are averaged. Groups named tp/intra/node measure intra-node links; dp/pp/inter/world measure
    the per-device inter-node share (an entry's optional "link" field overrides the name).
    """
    with open(preflight_path) as fh:
        try:
            entries = json.load(fh)
        except ValueError as exc:
            raise ValueError(f"--calibrate-links {preflight_path}: not JSON ({exc}); give the "
                             f"preflight's --json file") from exc
    if isinstance(entries, dict):
        entries = entries.get("results", entries.get("links", []))
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--calibrate-links {preflight_path}: expected a list of "
                         f"{{op, group, bytes, busbw_gbps}} objects")
    found: dict[str, list[tuple[float, float]]] = {"intra": [], "inter": []}
    for entry in entries:
        group = str(entry.get("link") or entry.get("group", "")).lower()
        cls = "intra" if group in _INTRA_GROUPS else "inter" if group in _INTER_GROUPS else None
        if cls and entry.get("busbw_gbps"):
            found[cls].append((float(entry.get("bytes", 0)), float(entry["busbw_gbps"])))
    out = {}
    for cls, rows in found.items():
        if rows:
            top = max(size for size, _ in rows)
            out[cls] = statistics.mean(bw for size, bw in rows if size == top)
    if not out:
        raise ValueError(f"--calibrate-links {preflight_path}: no entry with a known group and busbw_gbps")
    return out
