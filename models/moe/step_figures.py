"""A training step's MoE figures, read with the step's one host wait, and the expert-bias update.

``StepFigures.of(chunks)`` knows the run's MoE layers (their global indices give each a slot, so
every rank's vector has the same length whichever layers it holds). After the backward,
``vector(...)`` puts this rank's figures on the device, without a host read:

    [aux share, z share, dropped assignments, load of MoE layer 0 (E), load of MoE layer 1 (E), ...]

from the totals of the layers' forwards (models/moe/totals.py): the balancing losses' shares
averaged over the step's micro-batches, the assignments a capacity dropped and, per layer, the
assignments the router chose per expert (before any drop), summed over the micro-batches. A
layer whose TP ranks route the same tokens counts on TP rank 0 only; under sequence parallelism
(each TP rank routes its own shard, ``MoELayer.tp_split``) every TP rank counts its tokens, and
the balancing shares of a TP group add up to the DP x CP rank's (models/moe/balancing.py), so
every token is counted once in every layout. The trainer sums the vector over the world in the
step's statistics all-reduce (engine/training/step.py) and ``read`` turns the sums into the
step's figures:

- ``moe_aux_loss``, ``moe_z_loss``: the balancing losses as trained (coefficients included), summed
  over the MoE layers, each layer's the mean of the DP x CP ranks' shares (a TP group's shares
  summed under sequence parallelism): layout-independent;
- ``moe_expert_load``: per expert, the assignments of the whole global batch summed over the MoE
  layers; ``moe_load_imbalance``: the largest over the MoE layers of a layer's max over mean load
  (1.0: balanced), not the summed load's, whose layers' imbalances can cancel;
- ``moe_tokens_dropped``: the (token, expert) assignments the capacity dropped in the step;
- ``loads``: the per-layer global loads, which ``update_expert_bias`` uses after the update.

Counts are exact in the fp32 all-reduce up to 2**24 per expert and layer and step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.moe.stats import moe_layers

FIXED = 3  # aux share, z share, dropped


@dataclass
class StepFigures:
    num_experts: int
    slots: dict          # global layer index -> slot in the vector's loads

    @classmethod
    def of(cls, chunks) -> "StepFigures | None":
        """None for a model without MoE layers (the MoE metrics are null then)."""
        cfg = getattr(chunks[0], "cfg", None) if chunks else None
        if cfg is None or cfg.num_experts is None:
            return None
        layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        return cls(cfg.num_experts, {layer: j for j, layer in enumerate(layers)})

    @property
    def width(self) -> int:
        return FIXED + len(self.slots) * self.num_experts

    def vector(self, chunks, num_microbatches: int, counted: bool, device) -> torch.Tensor:
        """This rank's figures (see the module docstring), fp32 on ``device``. ``counted``: whether
        this rank counts the layers whose TP ranks route the same tokens (TP rank 0); layers under
        sequence parallelism count on every rank. No host read."""
        out = torch.zeros(self.width, dtype=torch.float32, device=device)
        e, m = self.num_experts, max(num_microbatches, 1)
        for layer in moe_layers(chunks):
            t = layer.totals
            if t is None or not (counted or layer.tp_split):
                continue
            out[0] += t.aux_loss.to(device) / m
            out[1] += t.z_loss.to(device) / m
            out[2] += t.dropped.to(device)
            at = FIXED + self._slot(layer) * e
            out[at:at + e] += t.load.to(device)
        return out

    def _slot(self, layer) -> int:
        if layer.layer_idx not in self.slots:
            raise ValueError(f"an MoE layer with global index {layer.layer_idx} is not an MoE layer "
                             f"of --moe-layer-freq: build it with build_mlp(cfg, layer_idx, ...)")
        return self.slots[layer.layer_idx]

    def read(self, sums: list[float], dp_cp: int) -> dict:
        """The step's figures from the world sums of ``vector``; ``dp_cp``: the DP x CP size."""
        e = self.num_experts
        loads = [[round(v) for v in sums[FIXED + j * e:FIXED + (j + 1) * e]]
                 for j in range(len(self.slots))]
        total = [sum(col) for col in zip(*loads)] if loads else [0] * e
        return {"moe_aux_loss": sums[0] / dp_cp, "moe_z_loss": sums[1] / dp_cp,
                "moe_tokens_dropped": round(sums[2]), "moe_expert_load": total,
                "moe_load_imbalance": worst_imbalance(loads), "loads": loads}


def imbalance(load) -> float | None:
    """max / mean of per-expert loads (1.0: balanced); None without any load."""
    mean = sum(load) / len(load) if len(load) else 0.0
    return max(load) / mean if mean > 0 else None


def worst_imbalance(loads: list[list[int]]) -> float | None:
    """The largest per-layer max / mean: layers loaded [30, 10] and [10, 30] give 1.5 (their sum,
    [40, 40], would say 1.0); None without any load."""
    values = [v for v in map(imbalance, loads) if v is not None]
    return max(values) if values else None


def moe_record(figures: dict | None, comm: dict, compiled: bool = False) -> dict:
    """The step record's MoE keys (null without MoE): the figures of ``read`` and the payload
    bytes handed to the dispatch collectives (group kind ``ep``), null under ``compiled``
    (--compile): the comm layer does not count the collectives traced into a compiled graph
    (parallel/runtime/comm.py), and which of the dispatch's run in eager islands depends on the
    dispatcher."""
    keys = ("moe_aux_loss", "moe_z_loss", "moe_expert_load", "moe_load_imbalance",
            "moe_tokens_dropped")
    if figures is None:
        return {**dict.fromkeys(keys), "ep_comm_bytes": None}
    return {**{k: figures[k] for k in keys},
            "ep_comm_bytes": None if compiled else comm["ep"]["payload_bytes"]}


def balancing_all_reduce(cfg, dp_cp: int) -> bool:
    """Whether the MoE layers' forward all-reduces over the DP x CP group (kind ``dp``/``dp_cp``):
    the global aux loss's counts (models/moe/balancing.py ``aux_loss_share``) with ``dp_cp`` > 1."""
    return (getattr(cfg, "num_experts", None) is not None and dp_cp > 1
            and cfg.moe_router_load_balancing_type == "aux_loss" and (cfg.moe_aux_loss_coeff or 0) > 0)


def update_expert_bias(chunks, figures: StepFigures, loads: list[list[int]]) -> None:
    """After an optimizer step: bias += rate * sign(mean load - load) for each MoE layer with an
    expert bias, ``loads`` being the global per-layer loads of ``StepFigures.read``: the same on
    every rank, so every layout moves the bias alike. Host values, copied without a wait."""
    for layer in moe_layers(chunks):
        bias = layer.router.expert_bias
        if bias is None:
            continue
        load = loads[figures._slot(layer)]
        mean = sum(load) / len(load)
        step = [layer.bias_update_rate * ((mean > v) - (mean < v)) for v in load]
        bias.add_(_to_device(step, bias.device))


def _to_device(values: list[float], device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    if torch.device(device).type in ("cpu", "meta"):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
