"""Model-side building blocks on top of the TP layers: norms, attention, MLPs.

Every module takes the ParallelState and a ``LayerContext`` (sequence parallelism, recomputation,
initializer) explicitly; user blocks can compose the same pieces.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import kernels
from models.config import GPTConfig
from parallel.context_parallel import (COMM_TYPES, context_parallel_attention, load_balanced,
                                       shard_positions)
from parallel.expert_parallel.host_read import HostReader
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import ColumnParallelLinear, Initializer, RowParallelLinear, divide
from parallel.tensor_parallel.layers import column_parallel_linears
from parallel.grads.weight_grad import layer_norm_split, rms_norm_split


@dataclass(frozen=True)
class LayerContext:
    """Run-level switches that layers need, handed down explicitly (no global args).

    ``kernel_paths``: the fused NPU ops this chip runs (the engine's device module chooses them
    from the chip's documented support; off an NPU they have no effect). ``rope_cache`` and
    ``mask_cache``: one RoPE table and one NPU causal mask shared by every layer built from this
    context, instead of one per layer call. ``rng``: the chunk's ``parallel.grid.random.RNGTracker``
    (dropout streams per region); None draws every mask from the default generator (single-process
    use of the layers). ``host_reader``: the MoE layers' split-size reads, one side stream per
    device shared by every layer (parallel/expert_parallel/host_read.py)."""
    init: Initializer
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    cp_comm_type: str = "p2p"  # context-parallel attention: p2p (ring) | a2a (Ulysses)
    kernel_paths: kernels.KernelPaths = kernels.ALL_FUSED
    rope_cache: kernels.RopeCache = field(default_factory=kernels.RopeCache, compare=False, repr=False)
    mask_cache: kernels.NpuMaskCache = field(default_factory=kernels.NpuMaskCache, compare=False,
                                             repr=False)
    rng: object = None
    cp_positions_cache: dict = field(default_factory=dict, compare=False, repr=False)
    # the MoE layers' host reads of their split sizes: one side stream per device for the model
    host_reader: HostReader = field(default_factory=HostReader, compare=False, repr=False)

    def cp_positions(self, s: int, cp_group, device) -> torch.Tensor:
        """(1, s) global positions of a context-parallel shard's s tokens, built once per shape and
        shared by every layer (one tensor, so the RoPE cache's lookup hits after the first layer)."""
        key = (s, cp_group.size, cp_group.rank, str(device))
        hit = self.cp_positions_cache.get(key)
        if hit is None:
            hit = shard_positions(s, cp_group.size, cp_group.rank, load_balanced(self.cp_comm_type),
                                  device).unsqueeze(0)
            self.cp_positions_cache[key] = hit
        return hit

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"--recompute must be none, selective or full, got {self.recompute!r}")
        if self.cp_comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be one of {COMM_TYPES}, got {self.cp_comm_type!r}")

    def fork_rng(self, region: str):
        """Draw random numbers from ``region``'s stream ("split", "replicated", or "hidden": split
        under sequence parallelism, else replicated) inside a ``with`` block."""
        if self.rng is None:
            return contextlib.nullcontext()
        if region == "hidden":
            region = "split" if self.sequence_parallel else "replicated"
        return self.rng.fork(region)

    def checkpoint(self, fn, *args):
        """``torch.utils.checkpoint`` that replays the same dropout masks in the recomputation
        (the dropout streams' states restored around it). A compiled graph takes no such context
        (torch.compile accepts dispatch modes only): there it is plain checkpointing, which the
        run's validation allows only without dropout (engine/training/validate.py)."""
        if self.rng is None or torch.compiler.is_compiling():
            return checkpoint(fn, *args, use_reentrant=False)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=self.rng.checkpoint_context)


class Dropout(nn.Module):
    """Dropout drawing from one region's stream of the ``LayerContext`` (see
    parallel/grid/random.py): ``"hidden"`` for activations of the residual stream (a sequence shard
    under sequence parallelism, else the same on every TP rank), ``"split"`` for a column-parallel
    output."""

    def __init__(self, p: float, ctx: LayerContext, region: str = "hidden"):
        super().__init__()
        if region not in ("hidden", "split", "replicated"):
            raise ValueError(f"Dropout region must be hidden, split or replicated, got {region!r}")
        self.p, self.ctx, self.region = p, ctx, region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.ctx.fork_rng(self.region):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dim; replicated weights, marked for the TP grad sum
    when they see only a sequence shard."""

    def __init__(self, kind: str, hidden: int, eps: float, sequence_parallel: bool = False,
                 paths: kernels.KernelPaths | None = None):
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"unknown norm {kind!r}; use layernorm or rmsnorm")
        self.kind, self.eps, self.paths = kind, eps, paths
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden)) if kind == "layernorm" else None
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel
        self.weight_grad_store = None  # a zero-bubble schedule's W takes the weight gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = self.weight_grad_store
        if store is not None:  # parallel/grads/weight_grad.py: fused-kernel arithmetic, W split off
            if self.kind == "layernorm":
                return layer_norm_split(x, self.weight, self.bias, self.eps, store)
            return rms_norm_split(x, self.weight, self.eps, store)
        if self.kind == "layernorm":
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return kernels.rms_norm(x, self.weight, self.eps, self.paths)


class ParallelAttention(nn.Module):
    """Causal self-attention: fused QKV column projection with whole key/value groups per TP rank,
    the attention kernel, and a row-parallel output projection.

    With n heads of size d in G key/value groups (grouped-query attention; G = n is plain multi-head
    attention) the logical QKV weight is ((n + 2G) d, h) with rows ordered
    (group, [the n/G query heads of the group | k | v], head_dim), Megatron-LM's grouping: a
    contiguous slice of rows gives a TP rank whole groups, and for G = n the order is
    (head, q|k|v, head_dim), the layout of multi-head checkpoints. Key/value heads are never
    repeated in memory: the kernel takes fewer of them.

    With ``cfg.qk_layernorm`` each head's query and key are RMS-normalised over head_dim after the
    projection and before RoPE (``q_norm``, ``k_norm``: one (d,) weight each, shared by every head,
    as Qwen3). The weight is replicated on the TP ranks but each rank sees only its own heads, so
    its gradient is partial: it is marked like a sequence-parallel norm weight and summed over TP
    once per step (parallel/grads/main_grad.py), which keeps the replicas equal.

    ``forward(x, inputs)`` takes the micro-batch's ``AttentionInputs`` (per-token positions for RoPE,
    documents for packed sequences); without them positions are 0..s-1 and each row one document.

    Under context parallelism (cp > 1) x is this rank's sequence shard and attention runs over the
    whole sequence through ``parallel.context_parallel`` (ring or Ulysses, ``ctx.cp_comm_type``);
    positions are the shard's global ones, from ``inputs`` or, without them, from the shard layout.
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, ctx: LayerContext, name: str,
                 bias: bool, rope: bool):
        super().__init__()
        h, n, g = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
        divide(h, ps.tp_size, "--hidden-size")
        self.heads_local = divide(n, ps.tp_size, "--num-attention-heads")
        self.groups_local = divide(g, ps.tp_size, "--num-query-groups")
        self.q_per_group = n // g
        self.head_dim, self.rope, self.rope_base = cfg.head_dim, rope, cfg.rope_base
        if rope and cfg.head_dim % 2:
            raise ValueError(f"--hidden-size {h} / --num-attention-heads {n} gives a head dimension "
                             f"of {cfg.head_dim}, which is odd: rotary embeddings turn pairs of "
                             f"channels; choose sizes with an even head dimension")
        self.dropout, self.selective = cfg.attention_dropout_p, ctx.recompute == "selective"
        self.cp_group, self.cp_comm_type = ps.cp_group, ctx.cp_comm_type
        self.paths, self.rope_cache, self.mask_cache = ctx.kernel_paths, ctx.rope_cache, ctx.mask_cache
        self.max_positions = cfg.seq_length
        self.ctx = ctx
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(h, (n + 2 * g) * cfg.head_dim, ps, f"{name}.qkv", ctx.init,
                                        bias=bias, sequence_parallel=ctx.sequence_parallel)
        self.proj = RowParallelLinear(h, h, ps, f"{name}.proj", ctx.init, bias=bias,
                                      sequence_parallel=ctx.sequence_parallel, std=out_std)
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:  # partial gradients on every TP rank: summed over TP (see above)
            partial = ps.tp_size > 1 or ctx.sequence_parallel
            self.q_norm = Norm("rmsnorm", cfg.head_dim, cfg.norm_eps, partial, ctx.kernel_paths)
            self.k_norm = Norm("rmsnorm", cfg.head_dim, cfg.norm_eps, partial, ctx.kernel_paths)

    def _core(self, q, k, v, document_ids=None, cu_seqlens=None):
        """Under context parallelism ``document_ids`` / ``cu_seqlens`` are the whole rows'."""
        dropout = self.dropout if self.training else 0.0
        # each TP rank holds its own heads (and under CP its own shard): their probabilities'
        # masks come from the split stream
        with self.ctx.fork_rng("split") if dropout > 0 else contextlib.nullcontext():
            if self.cp_group.size > 1:
                return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type,
                                                  dropout_p=dropout, document_ids=document_ids,
                                                  cu_seqlens=cu_seqlens, mask_cache=self.mask_cache,
                                                  paths=self.paths)
            return kernels.attention(q, k, v, causal=True, dropout_p=dropout,
                                     document_ids=document_ids, cu_seqlens=cu_seqlens,
                                     mask_cache=self.mask_cache, paths=self.paths)

    def _positions(self, inputs, s: int, device) -> torch.Tensor | None:
        """(b or 1, s) global positions of the tokens here, or None for plain 0..s-1."""
        if inputs is not None:
            return inputs.position_ids
        if self.cp_group.size == 1:
            return None
        return self.ctx.cp_positions(s, self.cp_group, device)

    def _documents(self, inputs):
        """(document_ids, cu_seqlens) attention reads: the shard's, or under CP the whole rows'."""
        if inputs is None or not inputs.packed:
            return None, None
        if self.cp_group.size > 1:
            if inputs.whole is None:
                raise ValueError("under context parallelism AttentionInputs must be a sequence "
                                 "shard made with select(), which keeps the whole rows")
            inputs = inputs.whole
        if torch.compiler.is_compiling():
            # the host ints would be Dynamo guards where they enter the graph (selective
            # recompute's checkpoint takes them as arguments: a graph per document count); the
            # compiled attention reads the ids' mask only (kernels/attention.py)
            return inputs.document_ids, None
        return inputs.document_ids, inputs.cu_seqlens

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, s, (n + 2G) d / tp) -> q (b, n/tp, s, d), k and v (b, G/tp, s, d), as views of the
        projection where the layout allows (always for k and v, for q when G = n)."""
        b, s, _ = qkv.shape
        r, d = self.q_per_group, self.head_dim
        qkv = qkv.view(b, s, self.groups_local, r + 2, d)
        q = qkv[:, :, :, :r].reshape(b, s, self.heads_local, d)  # (b, s, n/tp, d)
        k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]  # (b, s, G/tp, d)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, inputs=None) -> torch.Tensor:  # (b, s[/tp], h)
        qkv = self.qkv(x)  # (b, s, (n + 2G) d / tp)
        b, s, _ = qkv.shape
        q, k, v = self.split_qkv(qkv)
        if self.q_norm is not None:  # over head_dim: q (b, n/tp, s, d), k (b, G/tp, s, d)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            pos = self._positions(inputs, s, x.device)
            if pos is None:  # (s, d), built once per shape (RopeCache)
                cos, sin = self.rope_cache.table(s, self.head_dim, self.rope_base, q.dtype, x.device)
            else:  # (b, 1, s, d): the angles of each token's own (global) position
                cos, sin = self.rope_cache.at(pos, self.head_dim, self.rope_base, q.dtype,
                                              self.max_positions)
            q, k = (kernels.apply_rope(q, cos, sin, self.paths),
                    kernels.apply_rope(k, cos, sin, self.paths))
        docs = self._documents(inputs)
        if self.selective and self.training and torch.is_grad_enabled():
            out = self.ctx.checkpoint(self._core, q, k, v, *docs)
        else:
            out = self._core(q, k, v, *docs)  # (b, n/tp, s, d)
        out = out.transpose(1, 2).reshape(b, s, self.heads_local * self.head_dim)
        return self.proj(out)  # (b, s[/tp], h)


class ParallelMLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama): column-parallel in, row-parallel out."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, ctx: LayerContext, name: str,
                 kind: str = "gelu", bias: bool = True):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        divide(f, ps.tp_size, "--ffn-hidden-size")
        sp = dict(sequence_parallel=ctx.sequence_parallel)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.kind, self.paths = kind, ctx.kernel_paths
        if kind == "gelu":
            self.fc1 = ColumnParallelLinear(h, f, ps, f"{name}.fc1", ctx.init, bias=bias, **sp)
        elif kind == "swiglu":
            self.gate = ColumnParallelLinear(h, f, ps, f"{name}.gate", ctx.init, bias=bias, **sp)
            self.up = ColumnParallelLinear(h, f, ps, f"{name}.up", ctx.init, bias=bias, **sp)
        else:
            raise ValueError(f"unknown MLP kind {kind!r}; use gelu or swiglu")
        self.fc2 = RowParallelLinear(f, h, ps, f"{name}.fc2", ctx.init, bias=bias, std=out_std, **sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s[/tp], h)
        if self.kind == "gelu":
            y = F.gelu(self.fc1(x), approximate="tanh")  # (b, s, f/tp)
        else:  # one collective (and under sequence parallelism one saved shard) serves both
            gate, up = column_parallel_linears([self.gate, self.up], x)  # (b, s, f/tp) each
            y = kernels.swiglu(gate, up, self.paths)
        return self.fc2(y)
