"""ZeRO-3's gather units of a pipeline rank and the peak of whole units gathered at once (see
zero3.py)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.plan.model import Layout, ModelShape, num_micro_batches
from engine.plan.params import (chunk_ranges, expert_params_per_layer, layer_params_per_device,
                                moe_dense_change_per_layer, virtual_stages)

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
    gpt2 = shape.block == "gpt2"
    vocab = shape.padded_vocab(t) * h / t
    # the tied output layer reads the embedding's weight where both are on this device
    tied_here = gpt2 and (p == 1 or layout.v_placement)
    units = []
    if virtual == 0:
        if gpt2:
            units.append(Unit("position", shape.max_positions * h, kept=True))
        units.append(Unit("embedding", vocab, kept=tied_here))
    for i in chunk_ranges(shape, layout)[virtual]:
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
