"""The mixture-of-experts layer that replaces a block's MLP, and ``build_mlp`` for blocks.

``MoELayer.forward(x)`` takes (b, s, h) and returns (b, s, h): route (models/moe/router.py), count
the assignments per expert once on the device (the load figure, the balancing loss and the
experts' row offsets all use that count; with the expert bias the balancing loss counts the
unbiased top-k, a second count), permute and, under EP, dispatch over ``ps.ep_group``
(parallel/expert_parallel: the split sizes' one host read; at ep 1 the rows stay and nothing is
read on the host), run the local experts (stacked weights, grouped GEMMs), combine, un-permute with
the router weights, add the always-active shared expert (a dense tensor-parallel ``ParallelMLP``),
and attach the balancing losses' gradient (models/moe/balancing.py: they ride along the
combine, whose backward hands them the step's scale). Dropless by default: every
assignment is computed; with a capacity factor the lowest-weighted assignments beyond each
expert's capacity are dropped, optionally padding each expert to it (models/moe/capacity.py).

Under tensor parallelism every TP rank holds an identical replica of its experts and router, and
the EP group joins ranks of one TP coordinate. Without sequence parallelism the ranks of a TP group
hold the same tokens (and compute the same gradients); with it each TP rank routes and dispatches
its own sequence shard, (b, s/tp, h) in and out (no gather before the layer; the shared expert
gathers and reduce-scatters as every ``ParallelMLP`` does), and the router's and experts'
parameters are marked ``sequence_parallel``: their partial gradients are summed over TP after the
DP reduction, as the norms' are (parallel/grads/main_grad.py). Under context parallelism each CP
rank holds a slice of every sequence; EP is drawn from the DP x CP ranks. With expert tensor
parallelism (``ps.etp_group``, the TP group) each TP rank holds a slice of every local expert: the
TP ranks route and dispatch the same tokens, each computes its partial fc2 output, and the combined
(T, h) outputs are summed over TP (one all-reduce, after the linear combine and un-permute: T h
elements against the experts' T K h); the tokens and router weights enter that region through
``copy_to_tp``, whose backward sums the slices' partial gradients. With sequence parallelism too
each TP rank routes its own shard; the shards' tokens, router weights and chosen experts are
all-gathered over TP (the backward reduce-scatters the slices' partial gradients), every TP rank
dispatches and computes its slices of the TP group's tokens, and the combined outputs are
reduce-scattered back to the shards (the backward all-gathers their gradients), as Megatron's
expert tensor parallelism under SP does; the router stays ``sequence_parallel``, the expert
slices do not (they see every token of the TP group). The balancing losses sum their
statistics over the ranks holding the other tokens of a micro-batch or sequence
(models/moe/balancing.py). The losses and loads of each forward are recorded for the step's
figures (models/moe/stats.py, models/moe/step_figures.py).
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from kernels.fp8_grouped import SegmentSlots
from models.config import GPTConfig
from models.layers import LayerContext, ParallelMLP
from models.moe.balancing import aux_loss_share, seq_aux_loss_share, z_loss_share
from models.moe.capacity import choose, expert_capacity, padded_rows
from models.moe.experts import LocalExperts
from models.moe.router import TopKRouter, stable_topk
from models.moe.totals import MoETotals
from parallel.grid.expert_groups import ExpertGrid
from parallel.expert_parallel import (allgather_combine, allgather_dispatch,
                                      alltoall_combine, alltoall_dispatch, alltoall_plan,
                                      count_per_expert, permute_padded, permute_tokens,
                                      unpermute_tokens)
from parallel.expert_parallel.permute import equal_counts, offsets_of
from parallel.grid.state import ParallelState
from parallel.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence, gather_sequence_values,
                                               reduce_from_tp, reduce_scatter_to_sequence)


class MoELayer(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState, ctx: LayerContext, name: str,
                 kind: str = "gelu", bias: bool = True, layer_idx: int | None = None):
        super().__init__()
        if layer_idx is None:  # "layers.L.mlp": the global index from the weights' name
            found = re.match(r"layers\.(\d+)\.", name)
            layer_idx = int(found.group(1)) if found else None
        self.layer_idx = layer_idx  # global layer index: the layer's slot in the step's figures
        # under sequence parallelism each TP rank routes its own tokens: figures count every TP rank
        self.tp_split = bool(ctx.sequence_parallel) and ps.tp_size > 1
        self.etp_group = ps.etp_group  # the TP group under expert tensor parallelism, else this rank
        # ETP with SP: route the own shard, gather the TP group's tokens for the expert slices
        self.etp_sp = self.etp_group.size > 1 and self.tp_split
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
        self.dispatcher = cfg.moe_token_dispatcher_type  # "alltoall" or "allgather"
        local = ExpertGrid.local_experts(e, ps.ep_group.size, ps.ep_group.rank)
        # FP8: the ranks holding other rows of the experts' (expert, source) row segments, over
        # which the weight gradients' column amaxes are reduced: the other sequence shards under
        # SP without ETP (the same experts on every TP rank), the other CP slices at ep 1; with
        # ep > 1 the CP slices of a micro-batch are other sources, here or on the replicas
        token_groups = (ps.tp_group,) if self.tp_split and not self.etp_sp else ()
        slots = None
        if ps.cp_size > 1 and ps.ep_group.size == 1:
            token_groups += (ps.cp_group,)
        elif ps.cp_size > 1:
            ep = ps.ep_group.size
            grid = ExpertGrid(ps.grid, ep)
            slots = SegmentSlots(grid.ep_group_start(ps.rank), ep, grid.micro_stride(),
                                 ps.dp_size, ps.edp_group)
        self.experts = LocalExperts(cfg, ctx, f"{name}.experts", kind, bias, local,
                                    (self.etp_group.rank, self.etp_group.size), self.etp_group,
                                    token_groups, slots)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_expert = None if shared is None else ParallelMLP(
            dataclasses.replace(cfg, ffn_hidden_size=shared), ps, ctx, f"{name}.shared_expert",
            kind=kind, bias=bias)
        if self.tp_split:  # replicas over TP that saw distinct tokens: gradients summed over TP
            # (under ETP the expert slices see the whole TP group's tokens: their gradients are
            # whole; the fc2 bias, used by ETP rank 0 only, is marked by ExpertMLP)
            experts = () if self.etp_sp else tuple(self.experts.parameters())
            for p in (*self.router.parameters(), *experts):
                p.sequence_parallel = True
        # the groups whose ranks hold other tokens of this micro-batch (summed shares), and of
        # each of its sequences (TP under sequence parallelism, CP)
        self.token_groups = (ps.tp_group,) if self.tp_split else ()
        self.seq_groups = self.token_groups + ((ps.cp_group,) if ps.cp_size > 1 else ())
        # the balancing losses' gradient factor, set per step (set_aux_grad_scale): a 0-d tensor
        # refilled in place, so a compiled graph reads it as an input, whatever the loss scale
        self.register_buffer("aux_grad_scale", torch.ones((), dtype=torch.float32),
                             persistent=False)
        self.totals: MoETotals | None = None  # the forwards' figures: reset_totals, totals.py
        # the split sizes' one host read under EP, on the model's one side stream per device
        self.host_reader = ctx.host_reader

    def _balancing_loss(self, routing, batch: int, counts: torch.Tensor):
        """This rank's share of the balancing losses (0-d fp32, or None without any), of the aux
        loss alone and of the z-loss alone (each detached, or None); ``counts`` (E,): the layer's
        assignments per expert of this rank's tokens. With the expert bias the aux losses count
        the top-k of the unbiased scores instead (Megatron-Core's ``compute_routing_scores_for_
        aux_loss``: one more top-k and count, on the device, only where a balancing loss runs)."""
        loss = None
        experts = routing.experts                                                    # (T, K)
        if self.router.expert_bias is not None and self.aux_coeff > 0 and \
                self.balancing in ("aux_loss", "seq_aux_loss"):
            experts = stable_topk(routing.scores, self.topk)[1]                      # (T, K)
            counts = count_per_expert(experts, self.num_experts)                     # (E,)
        if self.balancing == "aux_loss" and self.aux_coeff > 0:
            loss, _ = aux_loss_share(routing.scores, counts, self.topk, self.aux_coeff,
                                     self.balance_group, self.token_groups)
        elif self.balancing == "seq_aux_loss" and self.aux_coeff > 0:
            loss = seq_aux_loss_share(routing.scores, experts, batch, self.aux_coeff,
                                      self.seq_groups, self.ps.cp_size)
        aux = None if loss is None else loss.detach()
        z = None
        if self.z_coeff > 0:
            split = self.ps.tp_size if self.tp_split else 1
            share = z_loss_share(routing.logits, self.z_coeff, split)
            loss = share if loss is None else loss + share
            z = share.detach()
        return loss, aux, z

    def _choose(self, routing, counts: torch.Tensor):
        """The capacity decision: (CapacityChoice or None (dropless), the kept assignments per
        expert (E,), the dropped count (0-d, on the device; None dropless))."""
        if self.capacity_factor is None:
            return None, counts, None
        t, k = routing.experts.shape
        e = self.num_experts
        choice = choose(routing.weights, routing.experts, e,
                        expert_capacity(t, k, e, self.capacity_factor))
        if self.pad_to_capacity:  # every expert exactly C rows
            kept = equal_counts(e, choice.capacity, counts.device)
        else:
            kept = count_per_expert(routing.experts, e, choice.keep)
        return choice, kept, choice.dropped.float()

    def _permute(self, tokens: torch.Tensor, routing, choice, kept: torch.Tensor):
        """(rows sorted by expert, Permutation, the padded capacity or None): dropless and with an
        unpadded capacity every copy (the dropped ones last), padded exactly C per expert."""
        e = self.num_experts
        if choice is None or not self.pad_to_capacity:
            rows, perm = permute_tokens(tokens, routing.experts, e, kept,
                                        None if choice is None else choice.keep)
            return rows, perm, None
        rows, perm = permute_padded(tokens, *padded_rows(choice, routing.experts), choice.capacity,
                                    choice.keep)
        return rows, perm, choice.capacity

    def _gather_routed(self, x: torch.Tensor, routing):
        """ETP with SP: the TP group's tokens (b, s, h) -> (b s, h) in sequence order, and their
        routing, each shard routed by its own TP rank: tokens and router weights all-gathered
        along the sequence (backward: reduce-scattered, summing the expert slices' partial
        gradients into each shard's), the chosen experts gathered as they are (no gradient)."""
        b, _, h = x.shape
        group, k = self.etp_group, self.topk
        tokens = gather_from_sequence(x, group).reshape(-1, h)                   # (T tp, h)
        weights = gather_from_sequence(routing.weights.view(b, -1, k), group).reshape(-1, k)
        experts = gather_sequence_values(routing.experts.view(b, -1, k), group).reshape(-1, k)
        return tokens, dataclasses.replace(routing, weights=weights, experts=experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s[/tp][/cp], h)
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)                                    # (T, h)
        routing = self.router(tokens)
        # the layer's one count of assignments per expert, on the device: the load figure (and
        # the expert bias's update), the balancing loss (without the bias) and (dropless) the
        # experts' row offsets
        counts = count_per_expert(routing.experts, self.num_experts)          # (E,)
        load = counts.float()                                                  # (E,) the figure
        loss, aux, z = self._balancing_loss(routing, b, load)
        # the balancing losses ride along the combine, which hands them their gradient (the
        # step's scale) in its backward: no autograd node of their own
        if loss is not None and not (loss.requires_grad and torch.is_grad_enabled()):
            loss = None
        scale = self.aux_grad_scale
        if self.etp_sp:  # the TP group's tokens, routed by their own TP ranks
            tokens_in, routing = self._gather_routed(x, routing)                 # (T tp, h)
            weights = routing.weights                                           # (T tp, K)
            routed = count_per_expert(routing.experts, self.num_experts)        # the group's
            # (every TP rank then drops the same assignments: counted once, by ETP rank 0)
        else:  # into the ETP region: identity, the backward sums the slices' partial gradients
            tokens_in = copy_to_tp(tokens, self.etp_group)                      # (T, h)
            weights = copy_to_tp(routing.weights, self.etp_group)               # (T, K)
            routed = counts
        choice, kept, dropped = self._choose(routing, routed)
        if self.dispatcher == "allgather":  # tokens travel, not rows: permute a zero-width view
            _, perm, capacity = self._permute(tokens_in[:, :0], routing, choice, kept)
            expert_in, state = allgather_dispatch(tokens_in, weights, perm, self.ep_group,
                                                  capacity, self.host_reader,
                                                  segments=self.experts.fp8 is not None)  # (N, h)
            expert_out = self.experts(expert_in, state.offsets, state.groups,
                                      state.segments)                          # (N, h)
            out = allgather_combine(expert_out, state, self.ep_group, loss, scale)  # (T, h)
        elif self.ep_group.size == 1:  # the rows stay here: the permutation's offsets serve
            rows, perm, padded = self._permute(tokens_in, routing, choice, kept)  # (T K or E C, h)
            # FP8's weight-gradient segments: each expert's kept rows (the dropped copies at the
            # end, weight 0, are in none, as under EP where they are not sent; None: every row)
            segments = offsets_of(kept) if (self.experts.fp8 is not None and choice is not None
                                            and padded is None) else None
            rows = self.experts(rows, perm.offsets, perm.groups, segments)       # (R, h)
            out = unpermute_tokens(rows, weights, perm, loss, scale)              # (T, h)
        else:
            capacity = choice.capacity if choice is not None and self.pad_to_capacity else None
            # the count exchange and the split sizes' host read go first; the read is waited
            # for once the permutation is queued (alltoall_dispatch)
            plan = alltoall_plan(kept, self.ep_group, capacity, self.host_reader)
            rows, perm, _ = self._permute(tokens_in, routing, choice, kept)       # (T K or E C, h)
            expert_in, state = alltoall_dispatch(rows, plan, self.ep_group,
                                                 segments=self.experts.fp8 is not None,
                                                 dropping=choice is not None and capacity is None)
            expert_out = self.experts(expert_in, state.offsets, state.groups,
                                      state.segments)                          # (N, h)
            rows = alltoall_combine(expert_out, state, self.ep_group)             # (R, h)
            out = unpermute_tokens(rows, weights, perm, loss, scale)              # (T, h)
        # the ETP slices' partial sums (identity without expert tensor parallelism); under SP
        # summed and cut back to this rank's shard (backward: the gradients all-gathered)
        if self.etp_sp:
            out = reduce_scatter_to_sequence(out.to(x.dtype).view(b, -1, h), self.etp_group)
        else:
            out = reduce_from_tp(out.to(x.dtype), self.etp_group).view(b, s, h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.etp_sp and self.etp_group.rank > 0:  # counted once, by ETP rank 0
            dropped = None
        # not a recomputation inside a backward (a compiled graph recomputes inside its own
        # backward graph and never runs this Python again); None: no such loss, nothing dropped
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            if self.totals is None:   # (a layer run without set_aux_grad_scale)
                self.reset_totals()
            self.totals.add(aux, z, load, dropped)
        return out

    def set_aux_grad_scale(self, scale: float) -> None:
        """The balancing losses' gradient factor from now on (outside any compiled graph)."""
        self.aux_grad_scale.fill_(float(scale))

    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.bfloat16()``, ...: the gradient factor stays fp32."""
        super()._apply(fn, recurse)
        if self.aux_grad_scale.dtype != torch.float32:
            self.aux_grad_scale = self.aux_grad_scale.float()
        return self

    def reset_totals(self) -> None:
        """Zero the summed figures of earlier forwards (models/moe/totals.py), on the layer's
        device; outside any compiled graph (models.moe.stats.set_aux_grad_scale, each step)."""
        device = self.router.weight.device
        if self.totals is None or self.totals.device != device:
            self.totals = MoETotals(self.num_experts, device)
        else:
            self.totals.zero_()


def build_mlp(cfg: GPTConfig, layer_idx: int, ps: ParallelState, ctx: LayerContext, name: str,
              kind: str = "gelu", bias: bool = True) -> nn.Module:
    """The MLP of global layer ``layer_idx``: an ``MoELayer`` where ``--moe-layer-freq`` puts one,
    else the dense ``ParallelMLP``. A user's block calls this to get MoE layers for free."""
    if cfg.is_moe_layer(layer_idx):
        return MoELayer(cfg, ps, ctx, name, kind=kind, bias=bias, layer_idx=layer_idx)
    return ParallelMLP(cfg, ps, ctx, name, kind=kind, bias=bias)
