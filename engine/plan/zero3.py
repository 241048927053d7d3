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

from dataclasses import dataclass

from engine.plan.collectives import gather_or_scatter_s
from engine.plan.memory import (expert_params_per_layer, layer_params_per_device,
                                moe_dense_change_per_layer, virtual_stages)
from engine.plan.model import Layout, ModelShape, num_micro_batches
from engine.plan.overlap import Overlapped, split

BACKWARD_WINDOW = 3   # whole units gathered at once in the backward (module docstring)


@dataclass(frozen=True)
class Unit:
    """One gather unit of a model chunk on one rank (its TP shard of the weights)."""
    name: str              # "position", "embedding", "layer 3", "final norm", "output"
    dense: float           # weights sharded over dp x cp
    expert: float = 0.0    # an MoE layer's experts (E/ep of them), sharded over the EDP group
    kept: bool = False     # gathered at its first read and kept until the update
    layer: int | None = None   # a transformer layer's global index

    @property
    def params(self) -> float:
        return self.dense + self.expert


def chunk_units(shape: ModelShape, layout: Layout, virtual: int) -> list[Unit]:
    """The gather units of virtual stage ``virtual`` in module order (= forward order)."""
    h, t, p = shape.hidden_size, layout.tp, layout.pp
    n = shape.num_layers // (p * layout.vp)
    gpt2 = shape.block == "gpt2"
    vocab = shape.padded_vocab(t) * h / t
    # the tied output layer reads the embedding's weight where both are on this device
    tied_here = gpt2 and (p == 1 or layout.v_placement)
    units = []
    if virtual == 0:
        if gpt2:
            units.append(Unit("position", shape.seq_length * h, kept=True))
        units.append(Unit("embedding", vocab, kept=tied_here))
    for i in range(virtual * n, (virtual + 1) * n):
        dense = layer_params_per_device(shape, t)
        if shape.is_moe(i):
            units.append(Unit(f"layer {i}", dense + moe_dense_change_per_layer(shape, t),
                              expert_params_per_layer(shape, layout.ep, layout.etp), layer=i))
        else:
            units.append(Unit(f"layer {i}", dense, layer=i))
    if virtual == p * layout.vp - 1:
        units.append(Unit("final norm", 2 * h if gpt2 else h))
        units.append(Unit("output", 0.0 if tied_here else vocab))
    return units


def stage_units(shape: ModelShape, layout: Layout, stage: int) -> list[list[Unit]]:
    """The units of each model chunk of pipeline rank ``stage``, chunk order."""
    return [chunk_units(shape, layout, vs) for vs in virtual_stages(layout, stage)]


def gather_bytes(shape: ModelShape, layout: Layout, stage: int) -> tuple[float, float]:
    """(DP x CP bytes, EDP bytes) a device of pipeline rank ``stage`` hands to ZeRO-3's
    all-gathers in one step: two gathers of each unit per chunk and micro-batch, one of each kept
    unit; the expert parts over the EDP group (with ep = 1 that is the dp x cp group: counted as
    DP). Zero over a group of one rank."""
    m, wb = num_micro_batches(shape, layout), shape.weight_bytes
    shards, edp = layout.dp * layout.cp, layout.edp
    units = [u for chunk in stage_units(shape, layout, stage) for u in chunk]
    dense = sum(u.dense * (1 if u.kept else 2 * m) for u in units)
    expert = sum(2 * m * u.expert for u in units)
    if layout.ep == 1:
        dense, expert = dense + expert, 0.0
    return (wb * dense / shards if shards > 1 else 0.0,
            wb * expert / edp if expert and edp > 1 else 0.0)


def gathered_bytes(shape: ModelShape, layout: Layout, stage: int) -> float:
    """The transient peak of gathered (whole) units on a device of pipeline rank ``stage``: the
    kept units plus the largest run of ``BACKWARD_WINDOW`` consecutive units of a chunk."""
    chunks = stage_units(shape, layout, stage)
    kept = sum(u.params for chunk in chunks for u in chunk if u.kept)
    run = 0.0
    for chunk in chunks:
        sizes = [0.0 if u.kept else u.params for u in chunk]
        run = max([run] + [sum(sizes[i:i + BACKWARD_WINDOW]) for i in range(len(sizes))])
    return shape.weight_bytes * (kept + run)


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
