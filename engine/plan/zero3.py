"""ZeRO-3 in the planner (``Layout.zero_stage == 3``, ``--data-parallel-sharding-strategy
optim_grads_params``): which units a device gathers, how many bytes, how much memory the gathered
copies take and how much of the gathers' time its compute hides. Pure arithmetic, no torch.

What the engine does (parallel/dp/zero3.py, zero3_units.py; docs/data_parallel.md, "ZeRO-3"):

- **Units.** A model chunk's gather units in module order (``chunk_units``): the chunk's own
  parameters (gpt2's position table), the embedding, every transformer layer, the final norm,
  the output layer. A unit's buckets hold its parameters only; dense weights are sharded over
  dp x cp, the experts of an MoE layer over their EDP group (dp x cp / ep).
- **Gathers.** Every unit is all-gathered ahead of its forward and freed after it, and gathered
  again when the first gradient reaches its outputs (before its backward) and freed when its
  inputs' gradients are complete: two all-gathers per unit, model chunk and micro-batch. Nothing
  is kept for a recomputation (``--recompute`` re-runs the forward inside the backward, after the
  backward's gather: no third gather) or for a zero-bubble W (it reads no weight). Kept gathered
  from their first read until the update, so gathered once per step: the chunk's own
  parameters and a weight read by two units (the tied output layer reads the embedding's weight
  when both are on the device: pp = 1, or zb-v's device 0). The payload of an all-gather is this
  rank's shard (parallel/runtime/comm.py): ``params / (dp cp) x weight bytes`` per gather.
- **Memory.** The persistent shards are ``weights`` (1/(dp cp), experts 1/edp); ``gathered`` is
  the transient peak of whole units: the kept buckets plus, in the backward, three consecutive
  units of a chunk: the one whose backward has just ended (its post-backward hook fires after the
  next unit's pre-backward hook, both on the same gradient), the current and the prefetched one;
  in the forward it is two (the current and the prefetched). ``gathered_bytes`` takes the largest
  run of three consecutive units of any chunk.
- **Time** (``gather_overlap``): with ``--overlap-param-gather`` a unit's forward gather is
  prefetched under the previous unit's forward and its backward re-gather under the next unit's
  backward; the first unit of each pass waits for its own (as does each kept bucket, once a
  step). Each pass's exposed part is ``first + sum max(0, gather_i - compute_beside_i)``, the
  rest hideable at the backend's ``zero`` overlap efficiency (overlap.split). The gradient
  reduce-scatter is ZeRO-2's (overlap.data_parallel_overlap).
"""
from __future__ import annotations

from engine.plan.collectives import gather_or_scatter_s
from engine.plan.model import Layout, ModelShape, num_micro_batches
from engine.plan.overlap import Overlapped, split
from engine.plan.zero3_units import Unit, stage_units


def _passes(gathers: list[float], beside: list[float]) -> Overlapped:
    """A pass over units in order: unit i's gather hides under ``beside[i]`` (the compute of the
    unit before it in the pass); the first unit's is waited for."""
    total = sum(gathers)
    if not gathers:
        return Overlapped()
    unhideable = gathers[0] + sum(max(0.0, g - c) for g, c in zip(gathers[1:], beside[1:]))
    return Overlapped(unhideable, total - unhideable)


def gather_overlap(shape: ModelShape, cluster, layout: Layout, dp_gbps: float, edp_gbps: float,
                   unit_times) -> Overlapped:
    """ZeRO-3's gathers of one step, exposed and hidden, for the stage exposed longest.
    ``unit_times(stage, unit)``: (forward, backward) seconds of ``unit`` per micro-batch on that
    stage (timing.py: a layer's PassTime, the embedding's, the logits'; 0 for norms)."""
    m, wb = num_micro_batches(shape, layout), shape.weight_bytes
    shards, edp, eff = layout.dp * layout.cp, layout.edp, cluster.overlap.zero

    def gather_s(u: Unit) -> float:   # (a unit with no weights of its own gathers nothing)
        if not u.params:
            return 0.0
        if layout.ep == 1 or edp == 1:
            return gather_or_scatter_s(u.params * wb, shards, dp_gbps)
        return (gather_or_scatter_s(u.dense * wb, shards, dp_gbps)
                + (gather_or_scatter_s(u.expert * wb, edp, edp_gbps) if u.expert else 0.0))

    worst = Overlapped()
    for stage in range(layout.pp):
        kept = step = Overlapped()
        for chunk in stage_units(shape, layout, stage):
            kept += Overlapped(sum(gather_s(u) for u in chunk if u.kept), 0.0)
            own = [u for u in chunk if not u.kept]
            g = [gather_s(u) for u in own]
            f, b = zip(*(unit_times(stage, u) for u in own)) if own else ((), ())
            forward = _passes(g, [0.0] + list(f[:-1]))
            backward = _passes(g[::-1], [0.0] + list(b[::-1][:-1]))
            step += (forward + backward).scale(m)
        if not layout.overlap_param_gather:
            step = Overlapped(step.total, 0.0)
        step = split(step.total, step.exposed, eff) + kept
        worst = max(worst, step, key=lambda o: o.exposed)
    return worst
