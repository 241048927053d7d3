"""The mixture-of-experts layer that replaces a block's MLP, and ``build_mlp`` for blocks.

``MoELayer.forward(x)`` takes (b, s, h) and returns (b, s, h): route (models/moe/router.py), permute
and dispatch over ``ps.ep_group`` (parallel/expert_parallel), run the local experts, combine,
un-permute with the router weights, add the always-active shared expert (a dense tensor-parallel
``ParallelMLP``), and attach the balancing losses' gradient (models/moe/balancing.py). Dropless
by default: every assignment is computed; with a capacity factor the lowest-weighted assignments
beyond each expert's capacity are dropped, optionally padding each expert to it
(models/moe/capacity.py).

Under tensor parallelism every TP rank holds the same tokens (sequence parallelism is refused in
this slice) and an identical replica of its experts; the EP group joins ranks of one TP
coordinate. The losses and loads of each forward are recorded for the step's figures
(models/moe/stats.py).
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from models.config import GPTConfig
from models.layers import LayerContext, ParallelMLP
from models.moe.balancing import (IdentityForwardAuxGradBackward, aux_loss_share, seq_aux_loss_share,
                                  z_loss_share)
from models.moe.capacity import choose, expert_capacity, padded_rows
from models.moe.experts import LocalExperts
from models.moe.router import TopKRouter
from parallel.expert_groups import ExpertGrid
from parallel.expert_parallel import (alltoall_combine, alltoall_dispatch, permute_padded,
                                      permute_tokens, unpermute_tokens)
from parallel.state import ParallelState


class MoELayer(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState, ctx: LayerContext, name: str,
                 kind: str = "gelu", bias: bool = True, layer_idx: int | None = None):
        super().__init__()
        if layer_idx is None:  # "layers.L.mlp": the global index from the weights' name
            found = re.match(r"layers\.(\d+)\.", name)
            layer_idx = int(found.group(1)) if found else None
        self.layer_idx = layer_idx  # global layer index: the layer's slot in the step's figures
        if ctx.sequence_parallel and ps.tp_size > 1:
            raise ValueError("--sequence-parallel with --num-experts is not built yet; drop "
                             "--sequence-parallel (tensor parallelism alone works)")
        if ps.cp_size > 1:
            raise ValueError("--cp > 1 with --num-experts is not built yet; use --cp 1")
        e = cfg.num_experts
        self.ps, self.num_experts, self.topk = ps, e, cfg.moe_router_topk
        self.ep_group, self.balance_group = ps.ep_group, ps.dp_cp_group
        self.balancing = cfg.moe_router_load_balancing_type
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff or 0.0
        self.router = TopKRouter(cfg.hidden_size, e, cfg.moe_router_topk, ctx.init, f"{name}.router",
                                 cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
                                 expert_bias=cfg.moe_router_enable_expert_bias)
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity
        local = ExpertGrid.local_experts(e, ps.ep_group.size, ps.ep_group.rank)
        self.experts = LocalExperts(cfg, ctx, f"{name}.experts", kind, bias, local)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_expert = None if shared is None else ParallelMLP(
            dataclasses.replace(cfg, ffn_hidden_size=shared), ps, ctx, f"{name}.shared_expert",
            kind=kind, bias=bias)
        self.aux_grad_scale = 1.0   # set per step: models.moe.stats.set_aux_grad_scale
        self.records: list[dict] = []

    def _balancing_loss(self, routing, batch: int):
        """This rank's share of the balancing losses (0-d fp32), of the aux loss alone (detached)
        and the assignments per expert of this rank's tokens (E,)."""
        loss = routing.logits.new_zeros(())
        if self.balancing == "aux_loss" and self.aux_coeff > 0:
            share, _ = aux_loss_share(routing.scores, routing.experts, self.aux_coeff,
                                           self.balance_group)
            loss = loss + share
        elif self.balancing == "seq_aux_loss" and self.aux_coeff > 0:
            loss = loss + seq_aux_loss_share(routing.scores, routing.experts, batch, self.aux_coeff)
        aux = loss.detach()
        if self.z_coeff > 0:
            loss = loss + z_loss_share(routing.logits, self.z_coeff)
        counts = torch.bincount(routing.experts.reshape(-1), minlength=self.num_experts).float()
        return loss, aux, counts

    def _permute(self, tokens: torch.Tensor, routing):
        """(rows sorted by expert, Permutation, the padded capacity or None, dropped count)."""
        e = self.num_experts
        if self.capacity_factor is None:
            rows, perm = permute_tokens(tokens, routing.experts, e)
            return rows, perm, None, routing.logits.new_zeros(())
        t, k = routing.experts.shape
        choice = choose(routing.weights, routing.experts, e,
                        expert_capacity(t, k, e, self.capacity_factor))
        dropped = choice.dropped.float()
        if not self.pad_to_capacity:
            rows, perm = permute_tokens(tokens, routing.experts, e, keep=choice.keep)
            return rows, perm, None, dropped
        rows, perm = permute_padded(tokens, *padded_rows(choice, routing.experts), choice.capacity)
        return rows, perm, choice.capacity, dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h)
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)                                    # (T, h)
        routing = self.router(tokens)
        loss, aux, counts = self._balancing_loss(routing, b)
        rows, perm, capacity, dropped = self._permute(tokens, routing)       # (R, h)
        expert_in, state = alltoall_dispatch(rows, perm.counts, self.ep_group, capacity)  # (N, h)
        expert_out = self.experts(expert_in, state.tokens_per_expert)          # (N, h)
        rows = alltoall_combine(expert_out, state, self.ep_group)               # (R, h)
        out = unpermute_tokens(rows, routing.weights, perm).to(x.dtype).view(b, s, h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside a backward
            self.records.append({"aux_loss": aux, "z_loss": (loss.detach() - aux),
                                 "load": counts.detach(), "dropped": dropped})
        if loss.requires_grad and torch.is_grad_enabled():
            out = IdentityForwardAuxGradBackward.apply(out, loss, self.aux_grad_scale)
        return out


def build_mlp(cfg: GPTConfig, layer_idx: int, ps: ParallelState, ctx: LayerContext, name: str,
              kind: str = "gelu", bias: bool = True) -> nn.Module:
    """The MLP of global layer ``layer_idx``: an ``MoELayer`` where ``--moe-layer-freq`` puts one,
    else the dense ``ParallelMLP``. A user's block calls this to get MoE layers for free."""
    if cfg.is_moe_layer(layer_idx):
        return MoELayer(cfg, ps, ctx, name, kind=kind, bias=bias, layer_idx=layer_idx)
    return ParallelMLP(cfg, ps, ctx, name, kind=kind, bias=bias)
