"""What a training loop does with the MoE layers of its model chunks once per step.

- ``set_aux_grad_scale(chunks, scale)`` before the step: the factor the token loss of a
  micro-batch is back-propagated with (1 / micro-batches per step, times the loss scale), so the
  balancing losses weigh the same in every layout (engine/training/step.py calls it).
- ``pop_moe_stats(chunks, m)`` after it: this rank's share of the step's balancing losses (summed
  over layers, averaged over its ``m`` micro-batches: sum it over the TP ranks of a layer under
  sequence parallelism, then mean it over the DP x CP ranks for the layout-independent value)
  and the per-expert loads (summed over layers and micro-batches). Each call zeroes the
  layers' totals (models/moe/totals.py).
"""
from __future__ import annotations

import torch

from models.moe.layer import MoELayer


def moe_layers(chunks) -> list[MoELayer]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def set_aux_grad_scale(chunks, scale: float) -> None:
    """At the start of a step: the balancing losses' gradient factor; zeroes the figures of
    earlier forwards (validation's, a previous step's) so they never pile up."""
    for layer in moe_layers(chunks):
        layer.set_aux_grad_scale(scale)
        layer.reset_totals()


def load_imbalance(load: torch.Tensor) -> float:
    """max / mean of the per-expert loads (1.0: perfectly balanced)."""
    mean = float(load.float().mean())
    return float(load.max()) / mean if mean > 0 else 0.0


def pop_moe_stats(chunks, num_microbatches: int) -> dict | None:
    """{"aux_loss", "z_loss", "load"} of the forwards on this rank since the last reset (``load``
    None when there was none), or None without MoE; reads the totals on the host and zeroes them."""
    layers = moe_layers(chunks)
    if not layers:
        return None
    aux = z = 0.0
    load = None
    for layer in layers:
        t = layer.totals
        if t is None or not float(t.forwards):
            continue
        aux += float(t.aux_loss) / num_microbatches
        z += float(t.z_loss) / num_microbatches
        load = t.load.clone() if load is None else load + t.load
        layer.reset_totals()
    return {"aux_loss": aux, "z_loss": z, "load": load}
