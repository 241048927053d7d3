"""Tensor-parallel layers. Each allocates only its shard and takes the ParallelState explicitly.

Parameters split over TP carry ``param.tp_sharded = True``; replicated parameters whose gradient is
computed from a sequence shard carry ``param.sequence_parallel = True`` (their grads are summed over
TP once per step). Biases of row-parallel layers are added once, after the reduction.

Under sequence parallelism a column-parallel layer keeps only its input's sequence shard for the
weight gradient and all-gathers it again in backward (split_linear.py). Each layer has a
``weight_grad_store`` (None by default): with a store attached (a zero-bubble schedule,
parallel/grads/weight_grad.py) its weight gradients wait for the schedule's W action. Under sequence
parallelism ``tp_comm_overlap`` (None by default; "auto" or "ring", set by
``overlap.set_tp_comm_overlap``) pipelines the all-gather before a column-parallel GEMM and the
reduce-scatter after a row-parallel GEMM with the GEMMs, chunk by chunk (overlap.py). ``fp8``
(None by default; a ``kernels.fp8.Fp8Recipe``, set by ``set_fp8``) runs the layer's three GEMMs
on float8 operands on whichever of these paths it takes, with scales over the logical tensors
(fp8.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8 import Fp8Recipe
from parallel.grid.state import ParallelState
from parallel.tensor_parallel.fp8 import Fp8Spec, column_spec, row_spec
from parallel.tensor_parallel.init import Initializer
from parallel.tensor_parallel.mappings import (copy_to_tp, gather_from_sequence, gather_from_tp,
                                               reduce_from_tp, reduce_scatter_to_sequence)
from parallel.tensor_parallel.overlap import (fused_linear_all_reduce, ring_gather_linear,
                                              ring_linear_reduce_scatter)
from parallel.tensor_parallel.split_linear import (embedding_defer_w, linear_defer_w,
                                                   seq_gather_linear)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp={denominator}; "
                         f"choose a tp that divides it")
    return numerator // denominator


def _mark(param: nn.Parameter, **flags) -> nn.Parameter:
    for key, value in flags.items():
        setattr(param, key, value)
    return param


class _Fp8Layer:
    """What both TP linears share for FP8: the recipe (``fp8``) and one ``Fp8Spec`` per path."""
    fp8: Fp8Recipe | None = None

    def fp8_spec(self, shard: bool) -> Fp8Spec | None:
        """The spec of this layer's call; ``shard``: the path holds a sequence shard of the
        column input (or of the row output's gradient) and gathers it around the GEMMs."""
        if self.fp8 is None:
            return None
        key = (self.fp8, shard)
        specs = self.__dict__.setdefault("_fp8_specs", {})
        if key not in specs:
            make = column_spec if isinstance(self, ColumnParallelLinear) else row_spec
            specs[key] = make(self.fp8, self.group, self.cp_group, shard)
        return specs[key]


class ColumnParallelLinear(_Fp8Layer, nn.Module):
    """y = x W^T + b with W split by output rows: rank r holds rows [r*out/tp, (r+1)*out/tp).

    Input is replicated over TP (or a sequence shard under sequence parallelism, gathered here);
    the output stays split along its last dim unless ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, name: str,
                 init: Initializer, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, std: float | None = None):
        super().__init__()
        self.group, self.sequence_parallel, self.gather_output = ps.tp_group, sequence_parallel, gather_output
        self.cp_group, self.fp8 = ps.cp_group, None  # FP8: amaxes over the tokens' CP shards too
        self.out_per_rank = divide(out_features, ps.tp_size, f"{name} output size")
        shard_args = dict(shard_dim=0, rank=ps.tp_rank, size=ps.tp_size)
        self.weight = _mark(init.param(f"{name}.weight", (out_features, in_features), std=std,
                                       **shard_args), tp_sharded=True)  # (out/tp, in)
        self.bias = _mark(init.param(f"{name}.bias", (out_features,), "zeros", **shard_args),
                          tp_sharded=True) if bias else None
        self.weight_grad_store = None
        self.tp_comm_overlap = None  # "auto" | "ring": overlap.py, under sequence parallelism

    def enter(self, x: torch.Tensor) -> torch.Tensor:  # (b, s[/tp], in) -> (b, s, in)
        """Bring the input into the TP region: all-gather the sequence under sequence parallelism,
        else identity (all-reduce of its gradient). Layers that read the same input should use
        ``column_parallel_linears`` (one collective each way, the shard saved once)."""
        if self.sequence_parallel:
            return gather_from_sequence(x, self.group)
        return copy_to_tp(x, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s[/tp], in) -> (b, s, out/tp)
        return column_parallel_linears([self], x)[0]

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_store is None and self.fp8 is None:
            return F.linear(x, self.weight, self.bias)
        return linear_defer_w(x, self.weight, self.bias, self.weight_grad_store,
                              self.fp8_spec(False))


def column_parallel_linears(layers: list[ColumnParallelLinear], x: torch.Tensor) -> list[torch.Tensor]:
    """Several column-parallel layers on the same input (SwiGLU's gate and up): one all-gather
    (or one all-reduce of the gradient) for all, under sequence parallelism one saved shard."""
    first = layers[0]
    if first.sequence_parallel and first.group.size > 1 and first.tp_comm_overlap:
        outs = ring_gather_linear(x, [m.weight for m in layers], [m.bias for m in layers],
                                  first.group, first.weight_grad_store, first.tp_comm_overlap,
                                  first.fp8_spec(True))
        outs = list(outs) if isinstance(outs, tuple) else [outs]
    elif first.sequence_parallel and first.group.size > 1:  # (b, s, out/tp) each, the shard saved
        outs = seq_gather_linear(x, [m.weight for m in layers], [m.bias for m in layers],
                                 first.group, first.weight_grad_store, first.fp8_spec(True))
        outs = list(outs) if isinstance(outs, tuple) else [outs]
    else:
        x = first.enter(x)
        outs = [m._linear(x) for m in layers]
    return [gather_from_tp(y, m.group) if m.gather_output else y for m, y in zip(layers, outs)]


class RowParallelLinear(_Fp8Layer, nn.Module):
    """y = x W^T + b with W split by input columns; input arrives split along its last dim.

    Partial products are all-reduced (or reduce-scattered along the sequence under sequence
    parallelism); the replicated bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, name: str,
                 init: Initializer, bias: bool = True, sequence_parallel: bool = False,
                 std: float | None = None):
        super().__init__()
        self.group, self.sequence_parallel = ps.tp_group, sequence_parallel
        self.cp_group, self.fp8 = ps.cp_group, None  # FP8: amaxes over the tokens' CP shards too
        divide(in_features, ps.tp_size, f"{name} input size")
        self.weight = _mark(init.param(f"{name}.weight", (out_features, in_features), std=std,
                                       shard_dim=1, rank=ps.tp_rank, size=ps.tp_size),
                            tp_sharded=True)  # (out, in/tp)
        self.bias = _mark(init.param(f"{name}.bias", (out_features,), "zeros"),
                          sequence_parallel=sequence_parallel) if bias else None
        self.weight_grad_store = None
        # "auto" | "ring": overlap.py (the ring under sequence parallelism; without it only a
        # fused GEMM + all-reduce where the device has one)
        self.tp_comm_overlap = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, in/tp)
        store, fp8 = self.weight_grad_store, self.fp8_spec(False)
        plain = store is None and fp8 is None
        if self.group.size == 1:  # nothing to reduce: the bias goes into the GEMM (addmm)
            return (F.linear(x, self.weight, self.bias) if plain
                    else linear_defer_w(x, self.weight, self.bias, store, fp8))  # (b, s, out)
        if self.sequence_parallel and self.tp_comm_overlap:  # GEMM chunks + reduce-scatter ring
            y = ring_linear_reduce_scatter(x, self.weight, self.group, store, self.tp_comm_overlap,
                                           self.fp8_spec(True))
            return y if self.bias is None else y + self.bias  # (b, s/tp, out)
        if self.tp_comm_overlap and not self.sequence_parallel and fp8 is None:  # fused GEMM + all-reduce
            y = fused_linear_all_reduce(x, self.weight, self.group, store, self.tp_comm_overlap)
            if y is not None:
                return y if self.bias is None else y + self.bias  # (b, s, out)
        y = F.linear(x, self.weight) if plain else linear_defer_w(x, self.weight, None, store, fp8)
        # (b, s, out) partial sums
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)  # (b, s/tp, out)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    step = multiple * tp
    return (vocab_size + step - 1) // step * step


def vocab_parallel_weight(vocab_size: int, hidden: int, ps: ParallelState, name: str,
                          init: Initializer, std: float | None = None) -> nn.Parameter:
    """This rank's rows of a (padded vocab, hidden) weight: real rows drawn at the unpadded logical
    shape (so every tp draws the same numbers), padding rows zero."""
    padded = padded_vocab_size(vocab_size, ps.tp_size)
    per_rank = padded // ps.tp_size
    full = torch.zeros(padded, hidden)
    full[:vocab_size] = init.full(f"{name}.weight", (vocab_size, hidden), std=std)
    start = ps.tp_rank * per_rank
    return _mark(nn.Parameter(full[start:start + per_rank].clone()), tp_sharded=True)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over TP; padding rows (>= vocab_size) are zero.

    Each rank looks up the tokens in its row range and contributes zeros for the others; the partial
    embeddings are all-reduced, or reduce-scattered along the sequence under sequence parallelism.
    """

    def __init__(self, vocab_size: int, hidden: int, ps: ParallelState, name: str,
                 init: Initializer, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = ps.tp_group, sequence_parallel
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, ps.tp_size)
        self.per_rank = self.padded_vocab // ps.tp_size
        self.start = ps.tp_rank * self.per_rank
        self.weight = vocab_parallel_weight(vocab_size, hidden, ps, name, init)  # (V_pad/tp, h)
        self.weight_grad_store = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_grad_store is None:
            return F.embedding(ids, self.weight)
        return embedding_defer_w(ids, self.weight, self.weight_grad_store)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, s) -> (b, s[/tp], h)
        if self.per_rank == self.padded_vocab:
            return self._lookup(tokens)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp(out, self.group)
