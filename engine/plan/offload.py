"""Optimizer offload in the planner (``Layout.offload``, ``--optimizer-cpu-offload
--optimizer-offload-fraction F``): host memory, the copies over the host link and the host's update.
Pure arithmetic, no torch.

What the engine does (parallel/dp/offload.py, docs/data_parallel.md, "Optimizer offload"): for F
of this rank's optimizer shard (whole buckets, the first reduced; the planner takes F itself) the
fp32 masters and AdamW's moments live in host memory, 12 bytes per element (also for fp32
weights: the host master is a copy of the device's shard), beside a host copy of the fp32
gradient shard (4 bytes) and, for bf16/fp16 weights, a staging copy in their dtype. Each step:

1. **down**: each bucket's reduced fp32 gradient shard to the host, as its reduction finishes,
   on a side stream: ``HOST_GRAD_BYTES`` per element over the host link, under the last
   micro-batch's backward (at least one bucket exposed, overlap.bucketed, the DP efficiency);
2. **update**: torch's AdamW (foreach) on the host, bucket by bucket once the gradient norm is
   known: ``HOST_ADAM_BYTES_PER_PARAM`` (+ ``HOST_CAST_BYTES_PER_PARAM`` for bf16/fp16 weights)
   per element at ``Cluster.host_update_gbps``, exposed (nothing computes beside it: the next
   forward needs the new weights; a one-step-delayed update is not built);
3. **up**: the new weights, in their dtype, bucket by bucket while the host updates the next:
   a two-stage pipeline, whose exposed part beyond the update is ``max(0, up - update)`` plus one
   bucket's copy.

The device keeps the rest, ``(1 - F)`` of the optimizer state, updated there (timing.py's
memory-bound optimizer term). On a CPU (gloo) host and device are one memory: no copies, and the
update costs what the device update would. ``python -m engine.plan --calibrate`` on an offloaded
run fits ``host_update_gbps`` to its ``time_optimizer_s`` (``fit_host_update_gbps``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from engine.plan.constants import (HOST_ADAM_BYTES_PER_PARAM, HOST_CAST_BYTES_PER_PARAM,
                                   HOST_GRAD_BYTES, OPTIMIZER_STATE_BYTES)
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.overlap import Overlapped, bucketed


@dataclass(frozen=True)
class HostTerms:
    """Host memory one device's process holds for the offloaded optimizer, by part."""
    optimizer: float = 0.0  # fp32 masters, Adam m and v of the offloaded shard
    grads: float = 0.0      # the gradient shard's host copy (+ the staging copy of bf16 weights)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict:
        return {"optimizer": self.optimizer, "grads": self.grads, "total": self.total}


def shard_elements(layout: Layout, dense: float, expert: float) -> float:
    """This rank's optimizer shard: dense weights over dp x cp, experts over their EDP group
    (all of them without the distributed optimizer)."""
    if not layout.zero:
        return dense + expert
    return dense / (layout.dp * layout.cp) + (expert / layout.edp if expert else 0.0)


def offloaded_elements(layout: Layout, dense: float, expert: float) -> float:
    return layout.offload * shard_elements(layout, dense, expert)


def host_memory(shape: ModelShape, layout: Layout, dense: float, expert: float) -> HostTerms:
    """Host bytes of a device holding ``dense`` and ``expert`` weights."""
    n = offloaded_elements(layout, dense, expert)
    staging = shape.weight_bytes if shape.weight_bytes != 4 else 0
    return HostTerms(OPTIMIZER_STATE_BYTES * n, (HOST_GRAD_BYTES + staging) * n)


HOST_FLAGS = {"host_link_gbps": ("host link", "--host-link-gbps"),
              "host_update_gbps": ("host memory bandwidth", "--host-memory-gbps")}


def _rate(cluster: Cluster, key: str) -> float | None:
    """GB/s of a host figure, None on a CPU (one memory), a one-line error where it is unknown."""
    value = getattr(cluster, key)
    if value is None and cluster.backend != "gloo":
        what, flag = HOST_FLAGS[key]
        raise ValueError(f"--optimizer-cpu-offload: {cluster.device.name} has no {what} figure in "
                         f"engine/plan/hardware.py; give {flag}")
    return value


def offload_known(cluster: Cluster) -> bool:
    """Whether the planner can price offload on ``cluster`` (the search weighs it only then)."""
    return cluster.backend == "gloo" or None not in (cluster.host_link_gbps, cluster.host_update_gbps)


def host_update_s(shape: ModelShape, cluster: Cluster, elements: float) -> float:
    """Seconds of the host's AdamW over ``elements`` (0 on a CPU, whose update is the device's)."""
    gbps = _rate(cluster, "host_update_gbps")
    if not elements or gbps is None:
        return 0.0
    cast = HOST_CAST_BYTES_PER_PARAM if shape.weight_bytes != 4 else 0
    return elements * (HOST_ADAM_BYTES_PER_PARAM + cast) / (gbps * 1e9)


def offload_time(shape: ModelShape, cluster: Cluster, layout: Layout, elements: float,
                 window_s: float, bucket: float) -> tuple[Overlapped, float]:
    """(the copies down and up, exposed and hidden; the host update's seconds) of a device whose
    offloaded shard has ``elements``; ``window_s``: its last backward, under which the copies
    down run; ``bucket``: one bucket's share of the shard."""
    update = host_update_s(shape, cluster, elements)
    link = _rate(cluster, "host_link_gbps")
    if not elements or link is None:
        return Overlapped(), update
    down = elements * HOST_GRAD_BYTES / (link * 1e9)
    up = elements * shape.weight_bytes / (link * 1e9)
    copies = bucketed(down, window_s, down * bucket, cluster.overlap.dp)
    up_exposed = max(0.0, up - update) + min(up, update) * bucket
    return copies + Overlapped(up_exposed, up - up_exposed), update


def most_host_terms(shape: ModelShape, layout: Layout) -> HostTerms:
    """The host memory of the device (pipeline stage) holding the most offloaded state."""
    from engine.plan.memory import stage_param_split
    return max((host_memory(shape, layout, *stage_param_split(shape, layout, stage))
                for stage in range(layout.pp)), key=lambda h: h.total)


def fraction_within(limit: float, at_full: float) -> float:
    """The largest offload fraction, in steps of 0.05 and at most 1, whose host part stays within
    ``limit`` bytes, the host part being linear in the fraction (``at_full`` bytes at 1)."""
    return min(1.0, math.floor(20 * limit / at_full) / 20) if at_full else 1.0


def host_fits(shape: ModelShape, cluster: Cluster, layout: Layout) -> bool:
    """Whether the offloaded part fits the host memory ``cluster`` gives each device (always
    without a figure, or without offload; on a CPU the device's memory check counts it)."""
    limit = cluster.host_bytes_per_device
    return limit is None or not layout.offload or cluster.backend == "gloo" or \
        most_host_terms(shape, layout).total <= limit


def largest_host_fraction(shape: ModelShape, cluster: Cluster, layout: Layout) -> float:
    """The largest offload fraction, in steps of 0.05, whose host part fits the host memory per
    device (1.0 without a figure)."""
    limit = cluster.host_bytes_per_device
    if limit is None or cluster.backend == "gloo":
        return 1.0
    return fraction_within(limit, most_host_terms(shape, replace(layout, offload=1.0)).total)


def most_offloaded(shape: ModelShape, layout: Layout) -> float:
    """The offloaded shard (elements) of the pipeline stage holding the most."""
    from engine.plan.memory import stage_param_split
    return max(offloaded_elements(layout, *stage_param_split(shape, layout, stage))
               for stage in range(layout.pp))


def offload_terms(shape: ModelShape, cluster: Cluster, layout: Layout,
                  backward_s: list[float]) -> tuple[Overlapped, float]:
    """(copies, host update seconds) of one step for the stage that waits longest: each stage's
    offloaded shard, its copies down under its window of the last backward
    (overlap.stage_windows of the stages' per-micro-batch ``backward_s``, pipeline order)."""
    from engine.plan.memory import stage_param_split
    from engine.plan.overlap import stage_windows
    if not layout.offload:
        return Overlapped(), 0.0
    windows = stage_windows(backward_s)
    worst = (Overlapped(), 0.0)
    for stage in range(layout.pp):
        dense, expert = stage_param_split(shape, layout, stage)
        grads = (dense + expert) * cluster.grad_reduce_bytes
        bucket = min(1.0, cluster.grad_bucket_bytes / grads) if grads else 1.0
        mine = offload_time(shape, cluster, layout, offloaded_elements(layout, dense, expert),
                            windows[stage], bucket)
        worst = max(worst, mine, key=lambda t: t[0].exposed + t[1])
    return worst
