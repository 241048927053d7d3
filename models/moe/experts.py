"""The experts of one MoE layer on this rank: a loop over local experts, or with
``--moe-grouped-gemm`` one grouped GEMM per projection over all of them (``kernels.grouped_linear``:
``torch._grouped_mm`` on CUDA, ``torch_npu.npu_grouped_matmul`` on the chips that document it, the
same loop elsewhere; kernels/grouped_gemm.py).

The weights stay one module per expert in both modes, so the parameter names
(``layers.L.mlp.experts.e.fc1.weight``), their initialisation and the checkpoints do not depend on
the flag: the grouped path stacks the local experts' weights per call into (E_local, out, in)
tensors (one copy of the layer's expert weights per forward; the stack's backward hands each
expert its slice of the grouped GEMM's weight gradient). Under a zero-bubble schedule (a
``WeightGradStore`` attached to the experts) each projection is one ``_GroupedLinearDeferW``
(models/moe/grouped_split.py) instead: the input gradient in B, one closure per projection
accumulating every expert's weight and bias gradients in W, as the looped experts' linears do.

Expert ``e`` (its GLOBAL index) draws its weights from (seed, ``{name}.{e}.fc1``, ...), so an
expert has the same values on whichever EP rank holds it. Every expert parameter is marked
``expert_parallel``: the reducer sums its gradient over ``ps.edp_group`` instead of the DP x CP
group, and the gradient norm adds the EP ranks' distinct experts.

Expert tensor parallelism (``--expert-tensor-parallel-size`` = tp, ``ps.etp_group`` the TP group)
splits every expert like the dense ``ParallelMLP``: fc1 (or gate and up) and the fc1 bias by output
rows, fc2 by input columns, each TP rank drawing its slice of the logical tensor
(``Initializer.param(..., shard_dim=, rank=, size=)``) and marking it ``tp_sharded`` with its
``tp_shard_dim`` (checkpoints store the logical tensor; the gradient norm counts every TP rank's
slice). Each rank's fc2 output is then a partial sum, reduced over TP by the layer after the
combine (models/moe/layer.py); the fc2 bias is whole on every TP rank and added by ETP rank 0
only, so it counts once in that sum, and it is marked ``sequence_parallel``: its gradient (on
ETP rank 0) is summed over TP once per step, keeping the replicas equal (parallel/grads.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from models.moe.grouped_split import grouped_linear_defer_w
from parallel.tensor_parallel.split_linear import linear_defer_w


class ExpertMLP(nn.Module):
    """One expert: GELU (fc1, fc2) or SwiGLU (gate, up, fc2), whole on one rank, or with
    ``etp = (rank, size)`` this ETP rank's slice of it (fc2's output then a partial sum)."""

    def __init__(self, hidden: int, ffn: int, kind: str, bias: bool, init, name: str,
                 out_std: float, paths=None, etp: tuple[int, int] = (0, 1)):
        super().__init__()
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"unknown MLP kind {kind!r}; use gelu or swiglu")
        rank, size = etp
        if ffn % size:
            raise ValueError(f"--moe-ffn-hidden-size {ffn} is not divisible by "
                             f"--expert-tensor-parallel-size {size}; choose a multiple of it")
        self.kind, self.paths = kind, paths
        self.fc2_bias_here = rank == 0  # the fc2 bias counts once in the sum over ETP
        ins = ("fc1",) if kind == "gelu" else ("gate", "up")
        for part in ins:  # split by output rows: (f/etp, h), bias (f/etp,)
            setattr(self, part, self._linear(init, f"{name}.{part}", ffn, hidden, bias, None,
                                             0, etp))
        # split by input columns: (h, f/etp); its bias whole
        self.fc2 = self._linear(init, f"{name}.fc2", hidden, ffn, bias, out_std, 1, etp)
        for p in self.parameters():
            p.expert_parallel = True
        if size > 1 and bias:  # used on ETP rank 0 only: its gradient summed over TP per step
            self.fc2["bias"].sequence_parallel = True
        self.weight_grad_store = None  # a zero-bubble schedule's W takes the weight gradients

    @staticmethod
    def _linear(init, name: str, out_f: int, in_f: int, bias: bool, std, dim: int,
                etp: tuple[int, int]) -> nn.ParameterDict:
        rank, size = etp
        split = dict(shard_dim=dim, rank=rank, size=size)
        params = {"weight": init.param(f"{name}.weight", (out_f, in_f), std=std, **split)}
        if bias:
            params["bias"] = init.param(f"{name}.bias", (out_f,), "zeros",
                                        **(split if dim == 0 else {}))
        if size > 1:
            for key, p in params.items():
                if key == "weight" or dim == 0:
                    p.tp_sharded, p.tp_shard_dim = True, dim
        return nn.ParameterDict(params)

    def _linear_apply(self, lin: nn.ParameterDict, x: torch.Tensor) -> torch.Tensor:
        bias = lin["bias"] if "bias" in lin else None
        if lin is self.fc2 and not self.fc2_bias_here:
            bias = None
        if self.weight_grad_store is None:
            return F.linear(x, lin["weight"], bias)
        return linear_defer_w(x, lin["weight"], bias, self.weight_grad_store)  # W split off

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, h)
        if self.kind == "gelu":
            y = F.gelu(self._linear_apply(self.fc1, x), approximate="tanh")  # (n, f/etp)
        else:
            y = kernels.swiglu(self._linear_apply(self.gate, x), self._linear_apply(self.up, x), self.paths)
        return self._linear_apply(self.fc2, y)  # (n, h), a partial sum over ETP


class LocalExperts(nn.Module):
    """The experts ``local`` (global indices) of one layer, applied to rows sorted by expert."""

    def __init__(self, cfg, ctx, name: str, kind: str, bias: bool, local: range,
                 etp: tuple[int, int] = (0, 1)):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.local, self.kind, self.paths = local, kind, ctx.kernel_paths
        self.grouped = bool(cfg.moe_grouped_gemm)
        self.experts = nn.ModuleDict({
            str(e): ExpertMLP(cfg.hidden_size, cfg.moe_ffn_hidden_size, kind, bias, ctx.init,
                              f"{name}.{e}", out_std, ctx.kernel_paths, etp) for e in local})

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:  # (n, h)
        if self.grouped and len(self.local) > 0:
            return self._grouped(x, tokens_per_expert)
        pieces = torch.split(x, tokens_per_expert)
        outs = [self.experts[str(e)](piece) for e, piece in zip(self.local, pieces)]
        return torch.cat(outs) if outs else x[:0]

    def _params(self, part: str):
        """The local experts' ``part`` weight Parameters (this ETP rank's shards) and biases, or
        None (no biases, or fc2's off ETP rank 0)."""
        lins = [getattr(self.experts[str(e)], part) for e in self.local]
        here = part != "fc2" or self.experts[str(self.local[0])].fc2_bias_here
        biases = [lin["bias"] for lin in lins] if "bias" in lins[0] and here else None
        return [lin["weight"] for lin in lins], biases

    def _stacked(self, part: str):
        """``_params`` stacked: weights (E_local, out, in) and biases (E_local, out) or None."""
        weights, biases = self._params(part)
        return torch.stack(weights), None if biases is None else torch.stack(biases)

    def _grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:  # (n, h)
        # attach_weight_grad_store gives the store to every expert: the first one's stands for all
        store = self.experts[str(self.local[0])].weight_grad_store

        def linear(inp, part):
            if store is not None:  # W split off: one deferred closure per projection
                weights, biases = self._params(part)
                return grouped_linear_defer_w(inp, weights, biases, counts, store, self.paths)
            weights, bias = self._stacked(part)
            return kernels.grouped_linear(inp, weights, counts, bias, self.paths)
        if self.kind == "gelu":
            y = F.gelu(linear(x, "fc1"), approximate="tanh")                     # (n, f/etp)
        else:
            y = kernels.swiglu(linear(x, "gate"), linear(x, "up"), self.paths)  # (n, f/etp)
        return linear(y, "fc2")                                                   # (n, h)
