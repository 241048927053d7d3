"""Where each of this rank's parameters sits in the logical (serial) tensors, and the run facts a
checkpoint records about its layout and data. Shared by the writer, the reader, export and generate.

A parameter that holds several logical tensors (the stacked expert weights of an MoE layer,
``param.logical_parts``: models/logical.py) gives one spec per logical tensor, each a contiguous
block of the parameter (``base``, ``shape``), so checkpoints name and store experts one by one
whatever the stacking. Flat ranges of a parameter (ZeRO's optimizer state, compression residuals)
are cut into its logical tensors' ranges by ``split_flat`` and put back together by ``read_flat``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass

import torch

from engine.checkpoint.index import CheckpointError
from models.output import OutputLayer
from parallel.grid.topology import normalise_order
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "virtual_pipeline_size", "placement", "order", "ep", "etp")


@dataclass
class ParamSpec:
    """Where this rank's tensor of a logical parameter sits in the global tensor."""
    name: str
    param: torch.nn.Parameter
    global_shape: list[int]
    offsets: list[int]       # of the local tensor inside the global one
    valid_shape: list[int]   # the local part inside the global shape (vocab padding rows dropped)
    writer: bool             # the copy that saves it (before the DP rule)
    owner: str = ""          # the parameter's own name (the optimizer's and the reducer's)
    base: int = 0            # flat offset of this logical tensor in the parameter
    shape: list[int] | None = None  # its local box (None: the parameter's shape)

    def __post_init__(self):
        self.owner = self.owner or self.name
        if self.shape is None:
            self.shape = list(self.param.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This logical tensor's box out of ``t`` (the parameter, or a tensor laid out like it)."""
        return t.reshape(-1)[self.base:self.base + self.numel].view(self.shape)


def split_flat(parts: list[ParamSpec], start: int, end: int, t: torch.Tensor):
    """The logical pieces of a parameter's flat range [start, end) holding ``t``: (spec, flat
    range inside the spec's box or None when whole, the piece of ``t``)."""
    out = []
    for s in parts:
        lo, hi = max(start, s.base), min(end, s.base + s.numel)
        if lo < hi:
            whole = lo == s.base and hi == s.base + s.numel
            out.append((s, None if whole else (lo - s.base, hi - s.base),
                        t.reshape(-1)[lo - start:hi - start]))
    return out


def read_flat(parts: list[ParamSpec], start: int, end: int, read) -> torch.Tensor | None:
    """A parameter's flat range [start, end) put together from its logical tensors:
    ``read(spec, flat range or None)`` returns a piece (None: the checkpoint lacks it)."""
    pieces = []
    for s in parts:
        lo, hi = max(start, s.base), min(end, s.base + s.numel)
        if lo < hi:
            whole = lo == s.base and hi == s.base + s.numel
            piece = read(s, None if whole else (lo - s.base, hi - s.base))
            if piece is None:
                return None
            pieces.append(piece.reshape(-1))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def by_owner(specs: list[ParamSpec]) -> dict[str, list[ParamSpec]]:
    """Each parameter's name -> its logical tensors' specs, in flat order."""
    out: dict[str, list[ParamSpec]] = {}
    for s in specs:
        out.setdefault(s.owner, []).append(s)
    return out


def param_specs(chunks, ps, vocab_size: int) -> list[ParamSpec]:
    """One spec per local parameter, under its layout-independent logical name."""
    shard: dict[int, tuple[int, bool]] = {}  # id(param) -> (shard dim, vocab-padded)
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, ColumnParallelLinear):
                shard.update({id(p): (0, False) for p in (m.weight, m.bias) if p is not None})
            elif isinstance(m, RowParallelLinear):
                shard[id(m.weight)] = (1, False)
            elif isinstance(m, VocabParallelEmbedding):
                shard[id(m.weight)] = (0, True)
            if isinstance(m, OutputLayer) and m.owns_weight:
                shard[id(m.weight)] = (0, True)
    specs = []
    for chunk in chunks:
        for name, p in chunk.logical_named_parameters():
            copy = getattr(p, "shared_embedding", False) and not chunk.pre_process
            parts = getattr(p, "logical_parts", None)
            if parts:  # a stacked parameter: one spec per logical tensor it holds
                prefix = name.rpartition(".")[0]
                for part in parts:
                    specs.append(_part_spec(f"{prefix}.{part.name}", p, part, ps, name, copy))
                continue
            local = list(p.shape)
            gshape, offsets, valid = list(local), [0] * len(local), list(local)
            sharded = getattr(p, "tp_sharded", False)
            if sharded or id(p) in shard:
                dim, vocab = shard.get(id(p), (getattr(p, "tp_shard_dim", None), False))
                if dim is None:
                    raise CheckpointError(f"parameter {name} is TP-sharded along an unknown dim: "
                                          f"set p.tp_shard_dim on it")
                offsets[dim] = ps.tp_rank * local[dim]
                gshape[dim] = local[dim] * ps.tp_size
                if vocab:
                    gshape[0] = vocab_size
                    valid[0] = max(0, min(local[0], vocab_size - offsets[0]))
            writer = not copy and (sharded or ps.tp_rank == 0)
            specs.append(ParamSpec(name, p, gshape, offsets, valid, writer))
    return specs


def _part_spec(name: str, p, part, ps, owner: str, copy: bool) -> ParamSpec:
    """The spec of one logical tensor inside a stacked parameter (its box split over TP along
    ``part.shard_dim``, or whole)."""
    local = list(part.shape)
    gshape, offsets = list(local), [0] * len(local)
    if part.shard_dim is not None:
        offsets[part.shard_dim] = ps.tp_rank * local[part.shard_dim]
        gshape[part.shard_dim] = local[part.shard_dim] * ps.tp_size
    writer = not copy and (part.shard_dim is not None or ps.tp_rank == 0)
    return ParamSpec(name, p, gshape, offsets, list(local), writer, owner, part.start, local)


def buffer_specs(chunks, ps) -> list[ParamSpec]:
    """One spec per saved buffer: each MoE router's expert bias (aux-loss-free balancing), under
    its router weight's logical name with ``expert_bias`` for ``weight``. The bias is the same
    on every rank (it moves with the global load), so TP rank 0 writes it (the DP rule applies
    as for parameters)."""
    specs = []
    for chunk in chunks:
        names = {id(p): n for n, p in chunk.logical_named_parameters()}
        for m in chunk.modules():
            bias = getattr(m, "expert_bias", None)
            if isinstance(bias, torch.Tensor) and id(getattr(m, "weight", None)) in names:
                name = names[id(m.weight)].rsplit(".", 1)[0] + ".expert_bias"
                shape = list(bias.shape)
                specs.append(ParamSpec(name, bias, shape, [0] * len(shape), shape, ps.tp_rank == 0))
    return specs


def first_replica(ps, param) -> bool:
    """Whether this rank writes its copy of ``param`` among the DP x CP ranks that hold it: the
    first of them, i.e. DP and CP rank 0 for dense parameters and expert-data-parallel rank 0 for
    an expert's (its EP peers at DP x CP ranks 1 .. ep-1 hold the other experts)."""
    if getattr(param, "expert_parallel", False) and getattr(ps, "edp_group", None) is not None:
        return ps.edp_group.rank == 0
    return ps.dp_rank == 0 and ps.cp_rank == 0  # CP ranks hold identical parameters too


def device_rng(dev) -> torch.Tensor | None:
    return dev.get_rng_state()


def saved_layout(index: dict) -> dict:
    """The layout an index records, in today's terms (cp=1 and the four-name order when absent)."""
    layout = {"cp": 1, "placement": "loop", "ep": 1, "etp": 1, **index["layout"]}
    layout["order"] = "-".join(normalise_order(layout["order"]))
    return layout


def layout_of(trainer) -> dict:
    cfg, g = trainer.cfg, trainer.grid
    return {"tp": g.tp, "cp": g.cp, "pp": g.pp, "dp": g.dp,
            "ep": cfg.parallel.expert_model_parallel_size,
            "etp": cfg.parallel.expert_tensor_parallel_size,
            "order": "-".join(normalise_order(cfg.parallel.order)),
            "virtual_pipeline_size": cfg.parallel.chunks_per_rank if g.pp > 1 else 1,
            "placement": cfg.parallel.placement,
            "use_distributed_optimizer": cfg.parallel.use_distributed_optimizer,
            "zero_stage": cfg.parallel.zero_stage,
            "sequence_parallel": cfg.parallel.sequence_parallel, "world_size": g.world_size,
            "precision": cfg.precision.precision, "compression": dataclasses.asdict(cfg.compression)}


def data_info(trainer) -> dict:
    data = trainer.data
    tok = getattr(data, "tokenizer_file", None)
    sha = None
    if tok and os.path.isfile(tok):
        with open(tok, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()
    return {"tokenizer": getattr(data.train, "tokenizer_spec", None), "vocab_size": data.vocab_size,
            "eot_id": getattr(data.train, "eot_id", None), "mock": data.prefix is None,
            "prefix": data.prefix, "tokenizer_sha256": sha, "tokenizer_file": tok if sha else None}
