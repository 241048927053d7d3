"""``python -m engine.plan``'s calibration and its one-line explanations (engine/tools/plan_cli.py
calls them): ``calibrated`` fits the cluster's constants to a measured run of the given layout
(engine/plan/calibrate.py, calibrate_moe.py), ``explain_empty`` says why no layout fits (``rules_problem``: why none obeys the rules)."""
from __future__ import annotations

import sys
from dataclasses import replace
from itertools import chain, product

from engine.base import ConfigError
from engine.plan.calibrate import (fit_achievable_fraction, fit_host_update_gbps,
                                   fit_overlap_efficiency, measured_exposed,
                                   measured_optimizer_time, measured_step_time)
from engine.plan.calibrate_moe import calibrate_moe
from engine.plan.memory import memory_per_device
from engine.plan.model import GIB, Cluster, Layout, ModelShape, check_layout
from engine.plan.offload import offload_known
from engine.plan.search import SearchSpace, candidate_layouts, escalations
from engine.plan.timing import estimate


def rules_problem(shape: ModelShape, cluster: Cluster, space: SearchSpace) -> str | None:
    """Why no layout of the space obeys the rules (None when one does): a pinned layout's rule,
    or the rules that reject the nearest layouts, each tp, cp, pp at its smallest micro-batch
    and plainest settings."""
    if next(candidate_layouts(shape, cluster, space), None) is not None:
        return None
    n, cps = cluster.num_devices, space.cp
    if space.tp and space.pp:
        dp = n // (space.tp * space.pp * cps[0])
        why = check_layout(shape, cluster, Layout(space.tp, space.pp, max(dp, 1), space.vp or 1,
                                                  space.micro_batch_size or 1, cp=cps[0],
                                                  order=space.order))
        return f"layout rejected: {why}" if why else None
    tps = [t for t in range(1, cluster.devices_per_node + 1) if cluster.devices_per_node % t == 0]
    pps = [p for p in range(1, shape.num_layers + 1) if shape.num_layers % p == 0]
    reasons, kinds = [], set()   # one per rule (its first words), the fewest dp ranks first
    splits = sorted((n // (tp * cp * pp), tp, cp, pp) for tp, cp, pp in product(tps, cps, pps)
                    if n % (tp * cp * pp) == 0)
    for dp, tp, cp, pp in splits:
        why = check_layout(shape, cluster, Layout(tp, pp, dp, 1, space.micro_batch_size or 1,
                                                  cp=cp, order=space.order))
        if why and " ".join(why.split()[:3]) not in kinds:
            kinds.add(" ".join(why.split()[:3]))
            reasons.append((f"tp={tp} cp={cp} pp={pp} dp={dp}", why))
    if not reasons:
        return (f"no layout obeys the rules: tp x cp x pp x dp = --devices {n} has no split with "
                f"cp in {','.join(map(str, cps))}")
    return "no layout obeys the rules: " + "; ".join(f"{lay}: {why}" for lay, why in reasons[:3])


def explain_empty(shape: ModelShape, cluster: Cluster, space: SearchSpace) -> str:
    """Why no layout of the space fits: ConfigError (exit 2, as engine.train refuses the same
    mistake) where no layout obeys the rules, else the least memory a pinned layout needs."""
    more = ("--recompute full, --zero on with --zero-stage 3 (ZeRO-3) or --optimizer-cpu-offload "
            "on" if offload_known(cluster) else "--recompute full or --zero on with --zero-stage 3")
    if (why := rules_problem(shape, cluster, space)):
        raise ConfigError(why)
    if space.tp and space.pp:
        tried = [lay for layout in candidate_layouts(shape, cluster, space)
                 for lay in [layout, *chain.from_iterable(escalations(layout, space, cluster))]]
        least = min((memory_per_device(shape, lay, cluster.backend).total for lay in tried),
                    default=None)
        if least is not None:
            return (f"layout needs at least {least / GIB:.1f} GiB per device, "
                    f"{cluster.usable_bytes / GIB:.1f} GiB usable; try {more} or a larger pp")
    return f"no layout fits in device memory; add devices, allow {more}"


def calibrated(args, shape: ModelShape, cluster: Cluster, space: SearchSpace) -> Cluster:
    """The cluster with its constants fitted to the measured run ``args.calibrate`` of the one
    layout the space pins (each fit prints a line on stderr). Its ZeRO stage and offload are the
    least of --zero-stage and --optimizer-cpu-offload (ZeRO-1, none by default: give
    ``--zero-stage 3`` or ``--optimizer-cpu-offload on`` for a run that used them)."""
    if not (space.tp and space.pp and space.micro_batch_size and len(space.recompute) == 1
            and len(space.zero) == 1 and len(space.cp) == 1
            and (space.tp == 1 or len(space.sequence_parallel) == 1)):
        raise ConfigError("--calibrate needs the measured run's --layout, --micro-batch-size, "
                          "--recompute, --zero, --cp and --sequence-parallel (one value each)")
    layout = next(candidate_layouts(shape, cluster, space), None)
    if layout is None:
        raise ConfigError(explain_empty(shape, cluster, space))
    if layout.offload:   # the host update's rate first: the step's fit takes it as given
        cluster = _host_rate(args, shape, cluster, layout)
    if shape.moe is not None:  # the MoE layers' engine terms (engine/plan/calibrate_moe.py)
        try:
            cluster, notes = calibrate_moe(shape, cluster, layout, args.calibrate,
                                           args.calibrate_dense)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for note in notes:
            print(f"calibrated {note}", file=sys.stderr)
        return cluster
    if args.calibrate_dense:
        raise ConfigError("--calibrate-dense applies to an MoE model (--num-experts)")
    step = measured_step_time(args.calibrate)
    tflops = estimate(shape, cluster, layout).flops.executed / step / cluster.num_devices / 1e12
    if shape.fp8_recipe:  # an FP8 run: its FP8 GEMMs' fraction, the bf16 one as given
        frac = fit_achievable_fraction(shape, cluster, layout, tflops, "fp8_achievable_fraction")
        print(f"calibrated FP8 achievable fraction {frac:.3f} from a measured step of {step:.4g} s "
              f"(FP8 peak {cluster.fp8_peak_tflops}; the bf16 parts at fraction "
              f"{cluster.achievable_fraction:.3f})", file=sys.stderr)
        return replace(cluster, fp8_achievable_fraction=frac)
    frac = fit_achievable_fraction(shape, cluster, layout, tflops)
    cluster = replace(cluster, achievable_fraction=frac)
    exposed = measured_exposed(args.calibrate)
    for _ in range(50 if exposed else 0):  # the efficiencies at that fraction, the fraction
        before = (frac, cluster.overlap)      # again with them, until neither moves
        cluster = replace(cluster, overlap=fit_overlap_efficiency(shape, cluster, layout, exposed))
        frac = fit_achievable_fraction(shape, cluster, layout, tflops)
        cluster = replace(cluster, achievable_fraction=frac)
        if abs(frac - before[0]) < 1e-9 and cluster.overlap == before[1]:
            break
    print(f"calibrated achievable fraction {frac:.3f} from a measured step of {step:.4g} s "
          f"({tflops:.2f} executed TFLOP/s per device, peak {cluster.peak_tflops})", file=sys.stderr)
    if exposed:
        eff = cluster.overlap
        print(f"calibrated overlap efficiency tp {eff.tp:.3f}, dp {eff.dp:.3f}, zero {eff.zero:.3f} "
              f"from the measured exposed communication ("
              + ", ".join(f"{k} {v:.4g} s" for k, v in exposed.items()) + ")", file=sys.stderr)
    return cluster


def _host_rate(args, shape: ModelShape, cluster: Cluster, layout: Layout) -> Cluster:
    """The cluster with the host update's rate fitted to the run's ``time_optimizer_s``."""
    measured = measured_optimizer_time(args.calibrate)
    if measured is None:
        raise ConfigError(f"--calibrate {args.calibrate}: no time_optimizer_s to fit the host "
                          f"update of --optimizer-cpu-offload to; give the metrics of a run of "
                          f"this engine")
    try:
        gbps = fit_host_update_gbps(shape, cluster, layout, measured)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    print(f"calibrated host update rate {gbps:.3g} GB/s from a measured update of "
          f"{measured:.4g} s", file=sys.stderr)
    return replace(cluster, host_update_gbps=gbps)
