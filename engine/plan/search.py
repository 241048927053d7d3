"""Cluster planner: ``python -m engine.plan`` ranks parallel layouts by predicted step time.

It enumerates (tp, cp, pp, dp, virtual stages, micro-batch size, recompute, ZeRO, sequence
parallelism and, for a mixture-of-experts model, ep and etp: 1 or tp) for the run's rank order
(``--order``, default tp-cp-dp-pp; cp = 1 unless ``--cp``), drops the layouts that break a
topology rule (engine/plan/model.check_layout), estimates each layout's memory and step time
(engine/plan/timing.py), prints the best first and then the ``torchrun ... -m engine.train``
command of the best. A layout that does not fit in device memory with the least sharding of the
space (``SearchSpace.zero_stages``, ``SearchSpace.offload``: ZeRO-1 and no offload by default) is
tried again with more (``escalations``: ZeRO-2, ZeRO-3, the optimizer offloaded to host memory,
alone and together), and the fastest of those that fit takes its place: in this model more
sharding never makes a layout faster (ZeRO-2 takes ZeRO-1's time, ZeRO-3 adds its gathers, the
offload its copies and the host's update), so it is weighed only where it is needed. ``--explain`` prints every term of each
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

from dataclasses import dataclass, replace
from itertools import product

# calibration lives in calibrate.py; its functions stay importable from here for existing callers
from engine.plan.calibrate import (fit_achievable_fraction, fit_overlap_efficiency,  # noqa: F401
                                   link_busbw, measured_exposed, measured_step_time)
from engine.plan.memory import memory_per_device
from engine.plan.model import Cluster, Layout, ModelShape, check_layout
from engine.plan.offload import host_fits, largest_host_fraction, offload_known
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
    # the ZeRO stages (with zero) and optimizer offload fractions (0: none) the search may use:
    # every layout starts at the least of each, the others are tried where it does not fit
    zero_stages: tuple[int, ...] = (1, 2, 3)
    offload: tuple[float, ...] = (0.0, 1.0)

    def __post_init__(self) -> None:
        if not self.zero_stages or set(self.zero_stages) - {1, 2, 3}:
            raise ValueError(f"ZeRO stages must be among 1, 2, 3, got {self.zero_stages!r}")
        if not self.offload or not all(0.0 <= f <= 1.0 for f in self.offload):
            raise ValueError(f"offload fractions must be in [0, 1], got {self.offload!r}")


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
                for zero in zeros(space, dp * cp):
                    for sp in sequence_parallels(space, tp):
                        for etp in expert_tensor_sizes(shape, tp, space):
                            layout = Layout(tp, pp, dp, vp, mbs, rc, zero, sp, cp, space.order,
                                            schedule, min(space.zero_stages),
                                            tp_comm_overlap=space.tp_comm_overlap,
                                            overlap_grad_reduce=space.overlap_grad_reduce,
                                            overlap_param_gather=space.overlap_param_gather,
                                            ep=ep, etp=etp,
                                            offload=min(space.offload) if zero else 0.0)
                            if check_layout(shape, cluster, layout) is None:
                                yield layout


def sequence_parallels(space: SearchSpace, tp: int) -> tuple[bool, ...]:
    """Sequence parallelism to enumerate at ``tp``: none without a TP group; with
    ``tp_comm_overlap`` only on, since engine.train refuses --tp-comm-overlap without
    --sequence-parallel (the command line refuses a space that pins it off with engine.train's
    line: engine/tools/train_check.py); else the space's."""
    if tp == 1:
        return (False,)
    if space.tp_comm_overlap:
        return tuple(sp for sp in space.sequence_parallel if sp)
    return space.sequence_parallel


def zeros(space: SearchSpace, dp_cp: int) -> tuple[bool, ...]:
    """The distributed optimizer's settings to enumerate: the space's with dp x cp > 1; with one
    rank only where every layout offloads (the optimizer offload needs it), else off (a layout
    that does not fit is offered the offload by ``escalations``)."""
    if dp_cp > 1:
        return space.zero
    return (True,) if min(space.offload) > 0 and True in space.zero else (False,)


def escalations(layout: Layout, space: SearchSpace, cluster: Cluster,
                shape: ModelShape | None = None) -> list[list[Layout]]:
    """The layouts with more sharding than ``layout`` that the space allows, in four tiers: ZeRO-2
    (as fast as ZeRO-1 in this model); ZeRO-3; ZeRO-1/2 with each larger offload fraction; ZeRO-3
    with them (module docstring). Within a tier the step time only grows along the list, so the
    first that fits is the tier's best. Higher stages need dp x cp > 1 and a layout with zero;
    offload needs the cluster's host figures; with a host memory figure (``--host-memory-gb``) and
    ``shape``, fractions whose host part does not fit give way to the largest that does. None for
    a layout without zero at dp x cp > 1: its twin with zero is escalated."""
    dp_cp = layout.dp * layout.cp
    if not layout.zero and (dp_cp > 1 or True not in space.zero):
        return []
    stage, f0 = layout.zero_stage, layout.offload
    low = [s for s in sorted(space.zero_stages) if stage <= s < 3] if dp_cp > 1 else [stage]
    three = dp_cp > 1 and 3 in space.zero_stages
    more = sorted(f for f in space.offload if f > f0) if offload_known(cluster) else []
    make = lambda s, f: replace(layout, zero=True, zero_stage=s, offload=f)  # noqa: E731
    if more and shape is not None:
        cap = largest_host_fraction(shape, cluster, make(stage, 1.0))
        more = sorted({min(f, cap) for f in more if min(f, cap) > f0})
    return [[make(s, f0) for s in low if s != stage] if layout.zero else [],
            [make(3, f0)] if three and stage != 3 and layout.zero else [],
            [make(s, f) for f in more for s in low],
            [make(3, f) for f in more] if three else []]


def fitting(shape: ModelShape, cluster: Cluster, layout: Layout, space: SearchSpace) -> Estimate | None:
    """The estimate of ``layout`` or, where it does not fit, of the fastest of its escalations
    that does: ZeRO-2's when it fits (no slower than the layout), else the best of the other
    tiers' first fits (ZeRO-3 with offload only where ZeRO-3 alone does not fit, being slower);
    None when none fits. Memory is checked first: only what fits is timed."""
    def fits(lay: Layout) -> bool:
        return memory_per_device(shape, lay, cluster.backend).total <= cluster.usable_bytes \
            and host_fits(shape, cluster, lay)
    if fits(layout):
        return estimate(shape, cluster, layout)
    tiers = escalations(layout, space, cluster, shape)
    if not tiers:
        return None
    first = lambda tier: next((lay for lay in tier if fits(lay)), None)  # noqa: E731
    zero2 = first(tiers[0])
    if zero2 is not None:
        return estimate(shape, cluster, zero2)
    zero3, offloaded = first(tiers[1]), first(tiers[2])
    both = first(tiers[3]) if zero3 is None else None
    found = [lay for lay in (zero3, offloaded, both) if lay is not None]
    return min((estimate(shape, cluster, lay) for lay in found), key=lambda e: e.step_time_s,
               default=None)


def search(shape: ModelShape, cluster: Cluster, space: SearchSpace = SearchSpace()) -> list[Estimate]:
    """Estimates of every feasible layout that fits in memory (escalated where it must be),
    fastest step first."""
    results = [e for e in (fitting(shape, cluster, lay, space)
                           for lay in candidate_layouts(shape, cluster, space)) if e is not None]
    return sorted(results, key=lambda e: e.step_time_s)
