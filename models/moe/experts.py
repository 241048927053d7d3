"""The experts of one MoE layer on this rank, as stacked weights and grouped GEMMs.

Each projection's local experts are ONE Parameter (``kernels.grouped_linear``: ``torch._grouped_mm``
on CUDA and on the CPU, ``torch_npu.npu_grouped_matmul`` on the chips that document it, a loop
elsewhere; kernels/grouped_gemm.py):

    GELU experts:    fc1_weight (E_local, f, h)     fc1_bias (E_local, f)    (with biases)
    SwiGLU experts:  gate_up_weight (E_local, 2 f, h): expert e's gate rows, then its up rows
                     (one grouped GEMM for both, then ``kernels.swiglu_packed``)
    both:            fc2_weight (E_local, h, f)     fc2_bias (E_local, h)    (with biases)

so a forward is two grouped GEMMs over every local expert, with nothing stacked per call and the
parameters themselves saved for backward. The whole MLP (both projections, the biases and the
activation) is ``kernels.grouped_mlp`` (kernels/grouped_experts.py): one autograd.Function with
its backward written out where ``torch._grouped_mm`` takes both projections, the composition of
two ``grouped_linear`` elsewhere. Each weight's gradient is one tensor, one slot
of the DP reducer's buffer (one add into the fp32 main gradient per projection, not one per
expert). The rows come sorted by local expert with ``offsets`` (E_local,) on the device, the
cumulative row counts: no count is read on the host.

Names: every expert is still its logical tensors, ``experts.{e}.fc1.weight`` (``gate``, ``up``,
``fc2``, biases), e the GLOBAL index, marked as ``logical_parts`` of the stacked parameters
(models/logical.py): checkpoints, resharding across ep and etp, Hugging Face import and export
and the checkpoints written before the weights were stacked name them that way
(engine/checkpoint/specs.py). Expert ``e`` draws each logical tensor from (seed,
``{name}.{e}.fc1.weight``, ...), so an expert has the same values on whichever EP rank holds it.
Every expert parameter is marked ``expert_parallel``: the reducer sums its gradient over
``ps.edp_group`` instead of the DP x CP group, and the gradient norm adds the EP ranks' distinct
experts.

Expert tensor parallelism (``--expert-tensor-parallel-size`` = tp, ``ps.etp_group`` the TP group)
splits every expert like the dense ``ParallelMLP``: fc1 (gate and up) and its bias by output rows,
fc2 by input columns, each TP rank drawing its slice of each logical tensor
(``Initializer.param(..., shard_dim=, rank=, size=)``), so the stacked parameters hold this
rank's slices, (E_local, f/tp, h) and so on, marked ``tp_sharded`` (each part records the logical
dim it splits; the gradient norm counts every TP rank's slice). Each rank's fc2 output is then a
partial sum, reduced over TP by the layer after the combine (models/moe/layer.py); the fc2 bias is
whole on every TP rank and added by ETP rank 0 only, so it counts once in that sum, and it is
marked ``sequence_parallel``: its gradient (on ETP rank 0) is summed over TP once per step,
keeping the replicas equal (parallel/grads/main_grad.py).

Under a zero-bubble schedule (a ``WeightGradStore`` attached) each projection is one
``_GroupedLinearDeferW`` (models/moe/grouped_split.py): the input gradient in B, one closure per
projection computing every expert's weight gradient as one grouped GEMM in W.
``--no-moe-grouped-gemm`` runs the same stacked weights as a loop of ``F.linear`` per expert
(``kernels.grouped_linear_reference``, reading the offsets on the host once per layer), the
reference the grouped paths are compared with.

FP8 (``fp8``: a ``kernels.fp8.Fp8Recipe``, set by ``parallel.tensor_parallel.fp8.set_fp8`` as on
the TP linears; docs/precision.md): both projections run their three GEMMs on float8 operands
(kernels/fp8_grouped.py; ``kernels.grouped_mlp``'s FP8 composition, or ``_GroupedLinearDeferW``'s
FP8 path under a zero-bubble store; under ``--no-moe-grouped-gemm`` the per-group loop), with
rowwise scales over the logical tensors: fc1's (gate and up) output features and fc2's input
features are split over ETP, so the amaxes along them are reduced over ``etp_group``; the weight
gradients' column scales, per (expert, source) row segment (``segments``), over ``token_groups``
(the ranks holding the other rows of the same segments) and, under EP with CP, per micro-batch
over its segments here and on the replicas (``slots``). The activation stays bf16.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.fp8 import Fp8Recipe
from kernels.fp8_grouped import GroupedFp8Spec, SegmentSlots
from kernels.grouped_gemm import host_counts, row_groups
from models.logical import LogicalPart, mark_parts
from models.moe.grouped_split import grouped_linear_defer_w


class LocalExperts(nn.Module):
    """The experts ``local`` (global indices) of one layer, or with ``etp = (rank, size)`` this
    ETP rank's slice of each, applied to rows sorted by local expert. ``etp_group`` (the ETP
    CommGroup), ``token_groups`` and ``slots`` are where FP8's amaxes are reduced (module
    docstring)."""

    fp8: Fp8Recipe | None = None

    def __init__(self, cfg, ctx, name: str, kind: str, bias: bool, local: range,
                 etp: tuple[int, int] = (0, 1), etp_group=None, token_groups: tuple = (),
                 slots: SegmentSlots | None = None):
        super().__init__()
        self.etp_group, self.token_groups, self.slots = etp_group, tuple(token_groups), slots
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"unknown MLP kind {kind!r}; use gelu or swiglu")
        hidden, ffn = cfg.hidden_size, cfg.moe_ffn_hidden_size
        rank, size = etp
        if ffn % size:
            raise ValueError(f"--moe-ffn-hidden-size {ffn} is not divisible by "
                             f"--expert-tensor-parallel-size {size}; choose a multiple of it")
        self.local, self.kind, self.paths = local, kind, ctx.kernel_paths
        self.grouped = bool(cfg.moe_grouped_gemm)  # False: the loop over the same weights
        self.ffn = ffn // size                     # this rank's f
        self.fc2_bias_here = rank == 0             # the fc2 bias counts once in the sum over ETP
        self.ins = ("fc1",) if kind == "gelu" else ("gate", "up")
        self.in_name = "fc1" if kind == "gelu" else "gate_up"
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        split = dict(rank=rank, size=size)
        sharded = size > 1

        def draw(part, e, what, shape, std=None, dim=None, kind_="normal"):
            return ctx.init.param(f"{name}.{e}.{part}.{what}", shape, kind_, std, shard_dim=dim,
                                  **split).data

        w_in = torch.stack([torch.cat([draw(p, e, "weight", (ffn, hidden), dim=0) for p in self.ins])
                            for e in local])
        self.register_parameter(f"{self.in_name}_weight", self._mark(
            w_in, [(f"{p}.weight", (self.ffn, hidden), 0) for p in self.ins], sharded))
        w_out = torch.stack([draw("fc2", e, "weight", (hidden, ffn), out_std, 1) for e in local])
        self.fc2_weight = self._mark(w_out, [("fc2.weight", (hidden, self.ffn), 1)], sharded)
        self.has_bias = bool(bias)
        if bias:
            b_in = torch.stack([torch.cat([draw(p, e, "bias", (ffn,), None, 0, "zeros")
                                           for p in self.ins]) for e in local])
            self.register_parameter(f"{self.in_name}_bias", self._mark(
                b_in, [(f"{p}.bias", (self.ffn,), 0) for p in self.ins], sharded))
            b_out = torch.stack([ctx.init.param(f"{name}.{e}.fc2.bias", (hidden,), "zeros").data
                                 for e in local])
            self.fc2_bias = self._mark(b_out, [("fc2.bias", (hidden,), None)], False)
            if sharded:  # used on ETP rank 0 only: its gradient summed over TP per step
                self.fc2_bias.sequence_parallel = True
        self.weight_grad_store = None  # a zero-bubble schedule's W takes the weight gradients

    def _mark(self, data: torch.Tensor, parts, sharded: bool) -> nn.Parameter:
        """``data`` (E_local, ...) as a Parameter whose logical parts are, per local expert, the
        ``parts`` (suffix, box shape, TP dim) in order."""
        p = nn.Parameter(data.contiguous())
        p.expert_parallel = True
        if sharded and any(dim is not None for _, _, dim in parts):
            p.tp_sharded = True
        logical, at = [], 0
        for e in self.local:
            for suffix, shape, dim in parts:
                part = LogicalPart(f"experts.{e}.{suffix}", at, tuple(shape),
                                   dim if sharded else None)
                logical.append(part)
                at += part.numel
        return mark_parts(p, logical)

    def fp8_spec(self) -> tuple[GroupedFp8Spec, GroupedFp8Spec] | None:
        """(fc1's, fc2's) FP8 spec under ``fp8``, else None: fc1 (gate and up) has its output
        features split over ETP, fc2 its input features."""
        if self.fp8 is None:
            return None
        specs = self.__dict__.setdefault("_fp8_specs", {})
        if self.fp8 not in specs:
            common = dict(token_groups=self.token_groups, loop=not self.grouped, slots=self.slots)
            etp = (self.etp_group,)
            specs[self.fp8] = (GroupedFp8Spec(self.fp8, out_groups=etp, **common),
                               GroupedFp8Spec(self.fp8, in_groups=etp, **common))
        return specs[self.fp8]

    @property
    def in_weight(self) -> nn.Parameter:
        return getattr(self, f"{self.in_name}_weight")

    @property
    def in_bias(self) -> nn.Parameter | None:
        return getattr(self, f"{self.in_name}_bias") if self.has_bias else None

    def _project(self, x: torch.Tensor, weight, bias, offsets: torch.Tensor, groups, fp8=None,
                 segments=None) -> torch.Tensor:
        store = self.weight_grad_store
        if store is not None:  # W split off: one deferred closure per projection
            return grouped_linear_defer_w(x, weight, bias, offsets, store, self.paths, fp8, segments)
        if not self.grouped:   # --no-moe-grouped-gemm: F.linear per expert (reads the offsets)
            return kernels.grouped_linear_reference(x, weight, host_counts(offsets), bias)
        return kernels.grouped_linear(x, weight, offsets, bias, self.paths, groups)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, groups: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:  # (n, h)
        """``x`` (n, h): rows sorted by local expert, expert i's ending at ``offsets[i]``;
        ``groups`` (n,): each row's local expert when the caller has it (a dropped copy at the
        end counts in the last group's); ``segments``: FP8's weight-gradient row segments (the
        rows of each (local expert, source), kernels/fp8_grouped.py; None: the experts)."""
        fp8 = self.fp8_spec()
        grouped = self.grouped or fp8 is not None
        if self.has_bias and grouped:  # each row's expert, once for both projections' biases
            groups = row_groups(offsets, x.shape[0]) if groups is None else groups
        else:
            groups = None
        fc2_bias = self.fc2_bias if self.has_bias and self.fc2_bias_here else None
        if grouped and self.weight_grad_store is None:  # the whole MLP: one grouped kernel
            return kernels.grouped_mlp(x, offsets, self.in_weight, self.fc2_weight, self.kind,
                                       self.in_bias, fc2_bias, groups, self.paths, fp8,
                                       segments)  # (n, h)
        fp8_in, fp8_out = (None, None) if fp8 is None else fp8
        y = self._project(x, self.in_weight, self.in_bias, offsets, groups, fp8_in,
                          segments)                                  # (n, f/etp) or (n, 2 f/etp)
        if self.kind == "gelu":
            y = F.gelu(y, approximate="tanh")
        else:
            y = kernels.swiglu_packed(y, self.paths)                 # (n, f/etp)
        return self._project(y, self.fc2_weight, fc2_bias, offsets, groups, fp8_out,
                             segments)                               # (n, h), partial over ETP
