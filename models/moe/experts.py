"""The experts of one MoE layer on this rank: a loop over local experts (the CPU path and the
reference that grouped GEMM kernels will be checked against).

Expert ``e`` (its GLOBAL index) draws its weights from (seed, ``{name}.{e}.fc1``, ...), so an
expert has the same values on whichever EP rank holds it. Every expert parameter is marked
``expert_parallel``: the reducer sums its gradient over ``ps.edp_group`` instead of the DP x CP
group, and the gradient norm adds the EP ranks' distinct experts.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels


class ExpertMLP(nn.Module):
    """One expert: GELU (fc1, fc2) or SwiGLU (gate, up, fc2), whole on one rank."""

    def __init__(self, hidden: int, ffn: int, kind: str, bias: bool, init, name: str,
                 out_std: float, paths=None):
        super().__init__()
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"unknown MLP kind {kind!r}; use gelu or swiglu")
        self.kind, self.paths = kind, paths
        ins = ("fc1",) if kind == "gelu" else ("gate", "up")
        for part in ins:
            setattr(self, part, self._linear(init, f"{name}.{part}", ffn, hidden, bias, None))
        self.fc2 = self._linear(init, f"{name}.fc2", hidden, ffn, bias, out_std)
        for p in self.parameters():
            p.expert_parallel = True

    @staticmethod
    def _linear(init, name: str, out_f: int, in_f: int, bias: bool, std) -> nn.ParameterDict:
        params = {"weight": nn.Parameter(init.full(f"{name}.weight", (out_f, in_f), std=std))}
        if bias:
            params["bias"] = nn.Parameter(init.full(f"{name}.bias", (out_f,), "zeros"))
        return nn.ParameterDict(params)

    @staticmethod
    def _linear_apply(lin: nn.ParameterDict, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, lin["weight"], lin["bias"] if "bias" in lin else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, h)
        if self.kind == "gelu":
            y = F.gelu(self._linear_apply(self.fc1, x), approximate="tanh")  # (n, f)
        else:
            y = kernels.swiglu(self._linear_apply(self.gate, x), self._linear_apply(self.up, x), self.paths)
        return self._linear_apply(self.fc2, y)  # (n, h)


class LocalExperts(nn.Module):
    """The experts ``local`` (global indices) of one layer, applied to rows sorted by expert."""

    def __init__(self, cfg, ctx, name: str, kind: str, bias: bool, local: range):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.local = local
        self.experts = nn.ModuleDict({
            str(e): ExpertMLP(cfg.hidden_size, cfg.moe_ffn_hidden_size, kind, bias, ctx.init,
                              f"{name}.{e}", out_std, ctx.kernel_paths) for e in local})

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:  # (n, h)
        pieces = torch.split(x, tokens_per_expert)
        outs = [self.experts[str(e)](piece) for e, piece in zip(self.local, pieces)]
        return torch.cat(outs) if outs else x[:0]
