"""Cluster planner: ``python -m engine.plan`` ranks parallel layouts by predicted step time.

It enumerates (tp, cp, pp, dp, virtual stages, micro-batch size, recompute, ZeRO-1, sequence
parallelism and, for a mixture-of-experts model, ep and etp: 1 or tp) for the run's rank order (``--order``, default tp-cp-dp-pp; cp = 1 unless ``--cp``),
drops the layouts that break a topology rule (engine/plan/model.check_layout) or do not fit in device
memory, estimates each survivor's step time (engine/plan/timing.py), prints the best first and then
the ``torchrun ... -m engine.train`` command of the best. ``--explain`` prints every term of each
estimate. ``--layout TP,PP[,VP]`` evaluates one layout instead. ``--calibrate`` fits the
achievable-compute fraction to a measured run; ``--calibrate-links`` takes link bandwidths from a
preflight measurement. docs/planner.md explains the model and every constant. The command line
(the model flags of engine.train's schema, the cluster, the search space) is
engine/tools/plan_cli.py; this module is the search.

Example (Narayanan et al. 2021, Table 1, 39.1B row)::

    python -m engine.plan --num-layers 48 --hidden-size 8192 --num-attention-heads 64 \\
        --vocab-size 51200 --seq-length 2048 --global-batch-size 1536 \\
        --device a100-80gb --devices 512 --grad-reduce-bytes 2 --attention unfused \\
        --recompute-early-stop off --recompute full --zero off --sequence-parallel off --explain
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

# calibration lives in calibrate.py; its functions stay importable from here for existing callers
from engine.plan.calibrate import (fit_achievable_fraction, fit_overlap_efficiency,  # noqa: F401
                                   link_busbw, measured_exposed, measured_step_time)
from engine.plan.model import Cluster, Layout, ModelShape, check_layout
from engine.plan.placement import DEFAULT_ORDER
from engine.plan.timing import Estimate, estimate


@dataclass(frozen=True)
class SearchSpace:
    """What to enumerate; a fixed value (or a one-element tuple) pins that dimension."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)
    cp: tuple[int, ...] = (1,)
    order: str = DEFAULT_ORDER
    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    micro_batch_size: int | None = None
    schedules: tuple[str, ...] = ("1f1b",)  # with pp > 1; add "zb-h1", "zb-v" to weigh them
    ep: tuple[int, ...] | None = None  # expert-parallel sizes (None: every one that divides)
    # expert tensor parallelism: "1" (whole experts on every TP rank) and/or "tp" (the TP group
    # splits every expert); weighed for MoE models with tp > 1
    etp: tuple[str, ...] = ("1", "tp")
    # the overlaps (Layout's fields, Megatron-LM's flags): --tp-comm-overlap, --overlap-grad-reduce,
    # --overlap-param-gather; the engine's defaults
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def expert_sizes(shape: ModelShape, dp_cp: int, space: SearchSpace) -> list[int]:
    """The ep sizes to weigh: 1 for a dense model, else those of ``space.ep`` (default: every
    one) that divide both dp x cp and the experts."""
    if shape.moe is None:
        return [1]
    wanted = space.ep or _divisors(dp_cp)
    return [ep for ep in wanted if dp_cp % ep == 0 and shape.moe.num_experts % ep == 0]


def expert_tensor_sizes(shape: ModelShape, tp: int, space: SearchSpace) -> list[int]:
    """The etp sizes to weigh for a layout of ``tp`` ranks: 1 and/or tp (``space.etp``) for an
    MoE model with tp > 1, else 1."""
    if shape.moe is None or tp == 1:
        return [1]
    return [1 if v == "1" else tp for v in space.etp]


def candidate_layouts(shape: ModelShape, cluster: Cluster, space: SearchSpace):
    """Every layout of the space that obeys the topology rules (memory is checked later)."""
    n, dpn = cluster.num_devices, cluster.devices_per_node
    for tp, cp, pp in product([space.tp] if space.tp else _divisors(dpn), space.cp,
                              [space.pp] if space.pp else _divisors(shape.num_layers)):
        if n % (tp * cp * pp):
            continue
        dp = n // (tp * cp * pp)
        vps = [space.vp] if space.vp else (_divisors(shape.num_layers // pp) if pp > 1 else [1])
        per_replica = shape.global_batch_size // dp if shape.global_batch_size % dp == 0 else 0
        mbss = [space.micro_batch_size] if space.micro_batch_size else _divisors(per_replica)
        for schedule in space.schedules if pp > 1 else ("1f1b",):
            chunks = {"zb-h1": [1], "zb-v": [2]}.get(schedule, vps)
            for vp, mbs, rc, ep in product(chunks, mbss, space.recompute,
                                           expert_sizes(shape, dp * cp, space)):
                for zero in space.zero if dp * cp > 1 else (False,):
                    for sp in space.sequence_parallel if tp > 1 else (False,):
                        for etp in expert_tensor_sizes(shape, tp, space):
                            layout = Layout(tp, pp, dp, vp, mbs, rc, zero, sp, cp, space.order,
                                            schedule, tp_comm_overlap=space.tp_comm_overlap,
                                            overlap_grad_reduce=space.overlap_grad_reduce,
                                            overlap_param_gather=space.overlap_param_gather,
                                            ep=ep, etp=etp)
                            if check_layout(shape, cluster, layout) is None:
                                yield layout


def search(shape: ModelShape, cluster: Cluster, space: SearchSpace = SearchSpace()) -> list[Estimate]:
    """Estimates of every feasible layout that fits in memory, fastest step first."""
    results = [e for e in (estimate(shape, cluster, lay) for lay in candidate_layouts(shape, cluster, space))
               if e.fits]
    return sorted(results, key=lambda e: e.step_time_s)
