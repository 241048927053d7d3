"""A GPT model chunk: the layers one pipeline (virtual) stage owns, plus the embedding on the first
stage and the final norm, output layer and loss on the last.

With pp=1 and one chunk it is the whole model. Tied input/output embeddings across stages: the last
stage keeps its own copy of the word-embedding shard (marked ``shared_embedding``), initialised from
the same logical weight; the pipeline sums the two copies' gradients over the embedding group. When
the first and the last virtual stage are chunks of the same rank (the V placement of zb-v), the
last chunk's output layer uses the first chunk's embedding weight itself: one parameter, no copy,
no all-reduce (it receives two gradients per micro-batch, ``uses_per_microbatch = 2``).
"""
from __future__ import annotations

import torch
from torch import nn

from models.batch import AttentionInputs
from models.blocks import recomputes_itself, takes_attention_inputs
from models.config import GPTConfig
from models.layers import Dropout, LayerContext, Norm
from models.output import OutputLayer
from models.registry import BlockRegistry, default_registry
from parallel.context_parallel import load_balanced, shard_positions
from parallel.grid.state import ParallelState
from parallel.tensor_parallel.fp8 import set_fp8
from parallel.tensor_parallel import (VocabParallelEmbedding, copy_to_tp, gather_from_sequence,
                                      padded_vocab_size, scatter_to_sequence,
                                      vocab_parallel_cross_entropy, vocab_parallel_weight)


class GPTChunk(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState, ctx: LayerContext, layers: range,
                 pre_process: bool = True, post_process: bool = True,
                 registry: BlockRegistry | None = None,
                 tied_embedding: VocabParallelEmbedding | None = None):
        """``tied_embedding``: on a last chunk, the first chunk's embedding on the same rank, whose
        weight the tied output layer then uses (not registered here: one parameter, one owner)."""
        super().__init__()
        if ctx.sequence_parallel and (cfg.seq_length // ps.cp_size) % ps.tp_size:
            per_cp = f" / cp={ps.cp_size}" if ps.cp_size > 1 else ""
            raise ValueError(f"--seq-length {cfg.seq_length}{per_cp} is not divisible by tp={ps.tp_size}: "
                             f"sequence parallelism keeps s/tp positions per rank; use a multiple "
                             f"of --tp or turn off --sequence-parallel")
        block_cls = (registry or default_registry()).resolve(cfg.block)
        self.cfg, self.ps, self.layer_range, self.block_cls = cfg, ps, layers, block_cls
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = ctx.sequence_parallel
        self.cp_balanced = load_balanced(ctx.cp_comm_type)
        self.learned_pos = block_cls.position == "learned"
        self.block_takes_inputs = takes_attention_inputs(block_cls)
        # --recompute full for a block that does not implement it: the chunk checkpoints it whole
        self.checkpoint_layers = ctx.recompute == "full" and not recomputes_itself(block_cls)
        self.layer_checkpoint = ctx.checkpoint
        self.layer_shapes_checked = False  # set after the first forward (check_layer_output)
        self.tied = block_cls.tie_embeddings
        self.vocab_start = ps.tp_rank * padded_vocab_size(cfg.vocab_size, ps.tp_size) // ps.tp_size
        h = cfg.hidden_size
        if pre_process:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, h, ps, "embedding.word", ctx.init,
                                                sequence_parallel=ctx.sequence_parallel)
            if self.learned_pos:
                self.pos = nn.Parameter(ctx.init.full("embedding.position",
                                                      (cfg.max_position_embeddings, h)))
            self.embed_drop = Dropout(cfg.dropout, ctx, "hidden")
        self.layers = nn.ModuleList(block_cls(cfg, i, ps, ctx) for i in layers)
        if post_process:
            self.final_norm = Norm(block_cls.final_norm, h, cfg.norm_eps, ctx.sequence_parallel,
                                   ctx.kernel_paths)
            if self.tied and not pre_process and tied_embedding is not None:
                tied_embedding.weight.uses_per_microbatch = 2
                self.output_layer = OutputLayer(tied=tied_embedding)  # the same rank's embedding
            elif self.tied and pre_process:
                self.output_layer = OutputLayer(tied=self.embed)
            else:
                name = "embedding.word" if self.tied else "output"
                weight = vocab_parallel_weight(cfg.vocab_size, h, ps, name, ctx.init)
                weight.shared_embedding = self.tied  # (V_pad/tp, h)
                self.output_layer = OutputLayer(weight)

    @property
    def output_weight(self) -> nn.Parameter:
        """The output weight this last chunk owns (AttributeError where it reads an embedding's)."""
        out = self._modules.get("output_layer")
        if out is None or not out.owns_weight:
            raise AttributeError("this chunk owns no output weight")
        return out.weight

    def output_matrix(self) -> torch.Tensor:
        return self.output_layer.matrix()

    @property
    def tied_on_rank(self) -> bool:
        """Whether this last chunk's output layer is the embedding of a chunk on this rank."""
        return self.post_process and not self.pre_process and not self.output_layer.owns_weight

    def shared_embedding_params(self) -> list[nn.Parameter]:
        """Both copies of a tied embedding that live on different stages (empty otherwise)."""
        if not self.tied or (self.pre_process and self.post_process) or self.tied_on_rank:
            return []
        if self.pre_process and getattr(self.embed.weight, "uses_per_microbatch", 1) > 1:
            return []  # the V placement: the last chunk on this rank uses this weight itself
        if self.pre_process:
            return [self.embed.weight]
        return [self.output_weight] if self.post_process else []

    def logical_named_parameters(self):
        """(name, param) with layout-independent names: global layer indices, and the tied output
        copy named after the word embedding it duplicates."""
        first = self.layer_range.start
        for name, p in self.named_parameters():
            if name.startswith("layers."):
                local, _, rest = name[len("layers."):].partition(".")
                name = f"layers.{first + int(local)}.{rest}"
            elif name == "embed.weight":
                name = "embedding.word.weight"
            elif name == "pos":
                name = "embedding.position"
            elif name == "output_layer.weight":
                name = "embedding.word.weight" if self.tied else "output.weight"
            yield name, p

    def _embed(self, tokens: torch.Tensor, inputs: AttentionInputs | None) -> torch.Tensor:
        x = self.embed(tokens)  # (b, s) -> (b, s[/tp], h)
        if self.learned_pos:
            if inputs is None and self.ps.cp_size == 1:
                pos = self.pos[: tokens.shape[1]].unsqueeze(0)  # (1, s, h)
            elif inputs is None:  # a context-parallel shard: its tokens' global positions
                cp = self.ps.cp_group
                pos = self.pos[shard_positions(tokens.shape[1], cp.size, cp.rank, self.cp_balanced,
                                               tokens.device)].unsqueeze(0)  # (1, s/cp, h)
            else:
                pos = self.pos[inputs.position_ids]  # (b, s, h): each token's own position
            if self.sequence_parallel:
                pos = scatter_to_sequence(pos, self.ps.tp_group)
            x = x + pos
        return self.embed_drop(x)

    def _run_layer(self, layer: nn.Module, x: torch.Tensor, inputs: AttentionInputs | None):
        args = (x,) if inputs is None else self._layer_args(x, inputs)
        if self.checkpoint_layers and self.training and x.requires_grad:
            return self.layer_checkpoint(layer, *args)  # replays the dropout masks
        return layer(*args)

    def _layer_args(self, x: torch.Tensor, inputs: AttentionInputs) -> tuple:
        if self.block_takes_inputs:
            return x, inputs
        if inputs.packed or self.block_cls.position == "rope":
            raise ValueError(f"--block {self.cfg.block}: its forward(x) takes no AttentionInputs, "
                             f"which {'packed documents' if inputs.packed else 'per-token positions'} "
                             f"need; define forward(self, x, inputs=None) and hand inputs to "
                             f"ParallelAttention")
        return (x,)  # learned positions are added by the embedding

    def check_layer_output(self, index: int, x: torch.Tensor, y) -> None:
        """A block must return its input's shape: (b, s/tp, h) under sequence parallelism (host
        shapes only, no device work)."""
        if isinstance(y, torch.Tensor) and y.shape == x.shape:
            return
        got = f"shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        why = (", (b, s/tp, h) under --sequence-parallel (each TP rank keeps its own sequence "
               "shard: return this rank's rows of what the block gathers; see docs/blocks.md)"
               if self.sequence_parallel else " (see docs/blocks.md)")
        raise ValueError(f"--block {self.cfg.block}: layer {index} returned {got} for an input of "
                         f"shape {tuple(x.shape)}; a block must return its input's shape{why}")

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                inputs: AttentionInputs | None = None) -> torch.Tensor:
        """First chunk: x is tokens (b, s); else hidden (b, s[/tp], h). The last chunk returns the
        per-token loss (b, s) when labels are given, else vocab-parallel logits (b, s, V_pad/tp).
        ``inputs``: the micro-batch's per-token positions and documents (None: 0..s-1, one
        document per row), the same on every pipeline stage."""
        if self.pre_process:
            x = self._embed(x, inputs)
        check = not torch.compiler.is_compiling() and not self.layer_shapes_checked
        for index, layer in zip(self.layer_range, self.layers):
            y = self._run_layer(layer, x, inputs)
            if check:  # the first forward only
                self.check_layer_output(index, x, y)
            x = y
        if check:
            self.layer_shapes_checked = True
        if not self.post_process:
            return x
        x = self.final_norm(x)
        if self.sequence_parallel:
            x = gather_from_sequence(x, self.ps.tp_group)  # (b, s, h)
        else:
            x = copy_to_tp(x, self.ps.tp_group)
        logits = self.output_layer(x)  # (b, s, V_pad/tp)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group, self.vocab_start,
                                            self.cfg.vocab_size)


def build_chunks(cfg: GPTConfig, ps: ParallelState, ctx, stage_ranges: list[range],
                 virtual_index: list[int], num_virtual: int,
                 registry: BlockRegistry | None = None) -> nn.ModuleList:
    """This rank's model chunks. ``virtual_index[i]`` is the global virtual stage of chunk i (with
    the V placement rank 0 holds stages 0 and 2pp-1: the first chunk's embedding then serves the
    last chunk's tied output layer); ``ctx`` is one LayerContext for all chunks or a list of one
    per chunk (each chunk its own dropout streams)."""
    ctxs = list(ctx) if isinstance(ctx, (list, tuple)) else [ctx] * len(stage_ranges)
    chunks: list[GPTChunk] = []
    for layers, v, c in zip(stage_ranges, virtual_index, ctxs):
        first = next((k for k in chunks if k.pre_process), None)
        chunks.append(GPTChunk(cfg, ps, c, layers, pre_process=(v == 0),
                               post_process=(v == num_virtual - 1), registry=registry,
                               tied_embedding=first.embed if first is not None else None))
    # what the reducer, the offload and the compressors' residuals treat as a copy on another
    # stage, marked once every chunk exists (the V's last chunk ties the first chunk's embedding
    # on this rank: no copy elsewhere)
    for chunk in chunks:
        for p in chunk.shared_embedding_params():
            p.tied_across_stages = True
    return nn.ModuleList(chunks)


def set_fp8_layers(chunks, recipe, num_layers: int, bf16_start: int = 0,
                   bf16_end: int = 0) -> list[int]:
    """Run the tensor-parallel GEMMs and the MoE experts' grouped GEMMs of every transformer layer
    of ``chunks`` in FP8 with ``recipe`` (a ``kernels.fp8.Fp8Recipe``), except the first
    ``bf16_start`` and the last ``bf16_end`` layers of the model (global indices), which stay bf16
    (Megatron-LM's --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16). The embedding,
    the output layer, norms, attention's softmax and the routers have no FP8 path. Returns the
    global indices of this rank's FP8 layers."""
    fp8 = []
    for chunk in chunks:
        for index, layer in zip(chunk.layer_range, chunk.layers):
            on = bf16_start <= index < num_layers - bf16_end
            set_fp8(layer, recipe if on else None)
            if on:
                fp8.append(index)
    return fp8
