"""The GPT of ``benchmarks/peers/compare.py`` trained with the parallelism that ships with PyTorch.

    torchrun --standalone --nproc-per-node 8 benchmarks/peers/native.py --tp 2 --pp 2 --dp 2 \\
        --out runs/peers/native.jsonl [model and batch flags as in compare.py]

One rank of the native run (``compare.py`` launches it). The composition, outermost first:

- Device mesh: ``init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``, so rank
  r sits at the same (tp, pp, dp) coordinate as in the engine's grid (order tp-dp-pp: tp fastest).
- Model: ``NativeGPT``, a plain single-device torch GPT-2 (LayerNorm, learned positions, fused QKV,
  GELU MLP, input/output embedding tied) whose weights are copied from the engine's serial
  ``GPTChunk`` built with the same seed, so both sides start from the same logical weights.
- Pipeline (pp > 1): the manual split of ``torch.distributed.pipelining`` (each rank builds only
  its layers, as torchtitan does; the layer split is the engine's ``stage_layers``), wrapped in
  ``PipelineStage`` and run by ``Schedule1F1B``. The tracing frontend ``pipeline()`` is not used:
  its stage modules are GraphModules whose submodules are ``InterpreterModule``s, and
  ``ColwiseParallel``/``RowwiseParallel`` accept only ``nn.Linear``/``nn.Embedding``, so DTensor TP
  cannot be applied after it. Tied embeddings across stages are not handled by the pipelining
  runtime: the last stage holds its own copy of the word embedding and the two copies' gradients
  are summed with one ``all_reduce`` over the (first, last) stage pair, as Megatron-LM does.
- Tensor parallel (tp > 1): ``parallelize_module`` on the tp sub-mesh with ``ColwiseParallel`` on
  the QKV and first MLP projections and ``RowwiseParallel`` on the attention output and second MLP
  projections. Embedding, output layer and loss stay replicated over TP (the engine shards the
  vocabulary; with the small vocabularies used here that is a few percent of the FLOPs).
- Data parallel (dp > 1): ``DistributedDataParallel(stage_module, device_mesh=mesh["dp"])``. Given
  a sub-mesh, DDP applies torch's DDP + TP bridge (``tensor.parallel.ddp._pre_dp_module_transform``:
  DTensor parameters become local shards for the reducer and are rebuilt as DTensors on forward).
  The pipelining runtime calls ``no_sync`` for all but the last micro-batch; without pipelining,
  gradient accumulation over the same micro-batches uses ``no_sync`` likewise.
- Optimizer: ``torch.optim.AdamW`` with the engine's decay groups and LR schedule; global-norm
  clipping counts each logical gradient once (sharded gradients summed over TP, the tied copy
  skipped, stages summed over PP), as torchtitan's ``clip_grad_norm_`` does.

Two things that torch 2.13 on gloo/CPU needs, found while building this (both are worked around
here, so every layout trains and matches the engine):
- ``PipelineStage`` with shapes inferred at run time (no ``input_args``/``output_args``) runs a real
  forward and backward through the DDP module for metadata inference; the DDP reducer then records
  every parameter twice in its first iteration and the next step fails in ``_rebuild_buckets``
  ("rebuilt parameter indices size is not same as original model parameters size ... 26 versus
  52"). Passing example ``input_args``/``output_args`` (static metadata; activations with
  ``requires_grad=True``, or no gradient is ever sent back) avoids the inference pass.
- ``Schedule1F1B(scale_grads=True)`` divides ``submod.parameters()``' gradients by the micro-batch
  count, but once DDP's TP bridge has rebuilt the TP weights as DTensor attributes they are no
  longer registered parameters, so their gradients stayed m times too large (dp=2, tp=2, pp=2:
  grad norm 1.94 instead of 1.06). The loss function divides by m instead (``scale_grads=False``).

Each step's global batch comes from ``engine.data.GlobalBatchSampler`` over the engine's mock
training split (``build_data(mock=True)``, a ``MockDataset``) with the same seed, so both sides see
the same samples; rank 0 writes one JSON line per step (``step``, ``loss``, ``grad_norm``, ``lr``,
``tokens``, ``step_time_s``, ``tokens_per_s``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config.schema import OptimConfig  # noqa: E402
from engine.data import GlobalBatchSampler, build_data, collate  # noqa: E402
from engine.training.lr_schedule import learning_rate  # noqa: E402
from engine.training.launch import exit_now  # noqa: E402
from parallel.pipeline.partition import stage_layers  # noqa: E402

TP_PLAN_KEYS = {"attn.qkv": "col", "attn.proj": "row", "mlp.fc1": "col", "mlp.fc2": "row"}


class Block(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.head_dim = h // heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(h, 3 * h), "proj": nn.Linear(h, h)})
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(h, ffn), "fc2": nn.Linear(ffn, h)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h)
        qkv = self.attn["qkv"](self.norm1(x))  # (b, s, 3h[/tp]) rows ordered (head, q|k|v, d)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # heads inferred: /tp
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (b, n, s, d)
        x = x + self.attn["proj"](y.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x)), approximate="tanh"))


class NativeGPT(nn.Module):
    """The layers ``layers`` of the GPT; the embedding when ``first``, final norm and tied output
    when ``last`` (its own copy of the word embedding when it is not also the first)."""

    def __init__(self, vocab: int, h: int, heads: int, ffn: int, seq: int, layers: range,
                 first: bool = True, last: bool = True):
        super().__init__()
        self.first, self.last, self.layer_range = first, last, layers
        if first:
            self.embed = nn.Embedding(vocab, h)
            self.pos = nn.Parameter(torch.zeros(seq, h))
        self.layers = nn.ModuleDict({str(i): Block(h, heads, ffn) for i in layers})
        if last:
            self.final_norm = nn.LayerNorm(h)
            if not first:
                self.output_weight = nn.Parameter(torch.zeros(vocab, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # (b, s) tokens -> (b, s, h)
            x = self.embed(x) + self.pos[: x.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        if not self.last:
            return x
        w = self.embed.weight if self.first else self.output_weight
        return F.linear(self.final_norm(x), w)  # (b, s, V)

    def tied_copy(self) -> nn.Parameter | None:
        """This stage's copy of the word embedding when it is split from its twin over PP."""
        if self.first and not self.last:
            return self.embed.weight
        return self.output_weight if self.last and not self.first else None


def native_name(logical: str, model: NativeGPT) -> str | None:
    """The NativeGPT parameter name of an engine logical name (None: not on this stage)."""
    if logical == "embedding.word.weight":
        return "embed.weight" if model.first else ("output_weight" if model.last else None)
    if logical == "embedding.position":
        return "pos" if model.first else None
    if logical.startswith("final_norm."):
        return logical if model.last else None
    _, idx, rest = logical.split(".", 2)
    return f"layers.{idx}.{rest}" if int(idx) in model.layer_range else None


def copy_engine_weights(model: NativeGPT, args) -> None:
    """Copy the engine's serial weights (same seed, same logical names) into this stage."""
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    cfg = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                    num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                    vocab_size=args.vocab_size, seed=args.seed)
    ref = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(args.seed, cfg.init_std)),
                   range(cfg.num_layers))
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for logical, p in ref.logical_named_parameters():
            name = native_name(logical, model)
            if name is None:
                continue
            mine = params[name]
            mine.copy_(p[: mine.shape[0]] if logical == "embedding.word.weight" else p)  # drop pad rows
            seen.add(name)
    missing = set(params) - seen
    if missing:
        raise RuntimeError(f"no engine weight for native parameters {sorted(missing)}")


def tp_plan(model: NativeGPT) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    style = {"col": ColwiseParallel, "row": RowwiseParallel}
    return {f"layers.{i}.{k}": style[v]() for i in model.layer_range for k, v in TP_PLAN_KEYS.items()}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("tp", 1), ("pp", 1), ("dp", 1), ("num-layers", 4), ("hidden-size", 64),
                          ("num-attention-heads", 4), ("seq-length", 64), ("vocab-size", 512),
                          ("micro-batch-size", 2), ("global-batch-size", 8), ("train-iters", 5),
                          ("lr-warmup-iters", 2), ("seed", 1234)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("lr", 1e-3), ("min-lr", 1e-4), ("weight-decay", 0.1), ("clip-grad", 1.0)):
        p.add_argument(f"--{name}", type=float, default=default)
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "zb-h1", "zb-v"),
                   help="Schedule1F1B, ScheduleInterleavedZeroBubble (one stage per rank), or "
                        "ScheduleZBVZeroBubble (two stages per rank in a V)")
    p.add_argument("--out", required=True, help="JSONL of per-step records (rank 0)")
    return p.parse_args(argv)


class NativeRun:
    """Everything one rank of the native job holds; ``step(k)`` runs optimizer step k (0-based)."""

    def __init__(self, args):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.args = a = args
        dist.init_process_group("gloo")
        self.mesh = init_device_mesh("cpu", (a.pp, a.dp, a.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_rank, self.dp_rank = self.mesh["pp"].get_local_rank(), self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.num_micro = a.global_batch_size // (a.micro_batch_size * a.dp)
        if a.schedule != "1f1b":
            self._init_zero_bubble(a)
            return
        layers = stage_layers(a.num_layers, a.pp, 1, self.pp_rank)[0]
        first, last = self.pp_rank == 0, self.pp_rank == a.pp - 1
        self.model = NativeGPT(a.vocab_size, a.hidden_size, a.num_attention_heads, 4 * a.hidden_size,
                               a.seq_length, layers, first, last)
        copy_engine_weights(self.model, a)
        if a.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module
            parallelize_module(self.model, self.mesh["tp"], tp_plan(self.model))
        self.first, self.last = first, last
        self.tied = self.model.tied_copy()
        self.tied_group = self._tied_group() if a.pp > 1 else None
        self.module = DDP(self.model, device_mesh=self.mesh["dp"]) if a.dp > 1 else self.model
        self.schedule = None
        if a.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B
            mb, sq, h = a.micro_batch_size, a.seq_length, a.hidden_size
            act = torch.zeros(mb, sq, h, requires_grad=True)  # (b, s, h) between stages
            x = torch.zeros(mb, sq, dtype=torch.long) if first else act
            y = torch.zeros(mb, sq, a.vocab_size, requires_grad=True) if last else act
            # static metadata (example inputs/outputs): see the module docstring
            stage = PipelineStage(self.module, self.pp_rank, a.pp, torch.device("cpu"),
                                  input_args=x, output_args=y, group=self.mesh["pp"].get_group())
            # divide the loss by m rather than scale_grads=True (see the module docstring)
            per_micro = lambda out, y: self.loss_fn(out, y) / self.num_micro  # noqa: E731
            self.schedule = Schedule1F1B(stage, self.num_micro, loss_fn=per_micro, scale_grads=False)
        self._init_optimizer(list(self.model.named_parameters()))

    def _init_zero_bubble(self, a) -> None:
        """torch.distributed.pipelining's zero-bubble schedules (tp = dp = 1): zb-h1 as
        ``ScheduleInterleavedZeroBubble`` with one stage per rank (its ZB1P is ZB-H1 there), zb-v
        as ``ScheduleZBVZeroBubble`` with two stages per rank in the V: rank r runs stages r and
        2p-1-r, rank 0 holds the embedding and the tied output layer (one parameter for both)."""
        from torch.distributed.pipelining import (PipelineStage, ScheduleInterleavedZeroBubble,
                                                  ScheduleZBVZeroBubble)
        if a.tp > 1 or a.dp > 1 or a.pp == 1:
            raise ValueError(f"--schedule {a.schedule} is built here for pp > 1 with tp = dp = 1")
        v = a.schedule == "zb-v"
        placement, chunks = ("v", 2) if v else ("loop", 1)
        total = a.pp * chunks
        stage_ids = [self.pp_rank, total - 1 - self.pp_rank] if v else [self.pp_rank]
        ranges = stage_layers(a.num_layers, a.pp, chunks, self.pp_rank, placement=placement)
        mb, sq, h = a.micro_batch_size, a.seq_length, a.hidden_size
        act = torch.zeros(mb, sq, h, requires_grad=True)  # (b, s, h) between stages
        self.stage_modules, stages = [], []
        for sid, layers in zip(stage_ids, ranges):
            model = NativeGPT(a.vocab_size, h, a.num_attention_heads, 4 * h, sq, layers,
                              sid == 0, sid == total - 1)
            copy_engine_weights(model, a)
            self.stage_modules.append(model)
        first = next((m for m in self.stage_modules if m.first), None)
        last = next((m for m in self.stage_modules if m.last), None)
        if first is not None and last is not None and first is not last:
            last.output_weight = first.embed.weight  # the V: the tied pair is one parameter
        for sid, model in zip(stage_ids, self.stage_modules):
            x = torch.zeros(mb, sq, dtype=torch.long) if model.first else act
            y = torch.zeros(mb, sq, a.vocab_size, requires_grad=True) if model.last else act
            stages.append(PipelineStage(model, sid, total, torch.device("cpu"), input_args=x,
                                        output_args=y, group=self.mesh["pp"].get_group()))
        per_micro = lambda out, y: self.loss_fn(out, y) / self.num_micro  # noqa: E731
        cls = ScheduleZBVZeroBubble if v else ScheduleInterleavedZeroBubble
        self.schedule = cls(stages, self.num_micro, loss_fn=per_micro, scale_grads=False)
        self.first, self.last = first is not None, last is not None
        self.model = self.module = None
        self.tied = None if v else (self.stage_modules[0].tied_copy())
        self.tied_group = None if v else self._tied_group()
        seen, named = set(), []
        for model in self.stage_modules:
            for n, q in model.named_parameters():
                if id(q) not in seen:
                    seen.add(id(q))
                    named.append((n, q))
        self._init_optimizer(named)

    def _init_optimizer(self, named) -> None:
        a = self.args
        decay = lambda n, q: q.ndim >= 2 and n != "pos"  # noqa: E731 - the engine's groups
        self.optimizer = torch.optim.AdamW(
            [{"params": [q for n, q in named if decay(n, q)], "weight_decay": a.weight_decay},
             {"params": [q for n, q in named if not decay(n, q)], "weight_decay": 0.0}],
            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        # the optimizer's parameters: under DDP + TP these are the local shards DDP registered (the
        # module's attributes turn back into DTensors during forward), so they are the stable list
        self.params = [q for g in self.optimizer.param_groups for q in g["params"]]
        self.optim_cfg = OptimConfig(train_iters=a.train_iters, lr=a.lr, min_lr=a.min_lr,
                                     lr_warmup_iters=a.lr_warmup_iters, weight_decay=a.weight_decay,
                                     clip_grad=a.clip_grad)
        self.data = build_data(None, a.seq_length, a.seed, mock=True, vocab_size=a.vocab_size).train
        self.sampler = GlobalBatchSampler(len(self.data), a.global_batch_size, a.seed)

    def _tied_group(self):
        """The (first stage, last stage) pair of every (tp, dp) coordinate; this rank's pair."""
        a, mine = self.args, None
        stride = a.tp * a.dp
        for r in range(stride):
            group = dist.new_group([r, r + (a.pp - 1) * stride])
            if dist.get_rank() % stride == r:
                mine = group
        return mine

    @staticmethod
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def _local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.args.global_batch_size // self.args.dp
        idx = self.sampler.micro_batches(step, self.dp_rank, self.args.dp, per_rank)[0]
        t = collate(self.data, idx)  # (b, s+1)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def _forward_backward(self, tokens, labels) -> float:
        """Mean loss of this rank's micro-batches (valid on last-stage ranks)."""
        if self.schedule is not None:
            losses: list = []
            inputs = (tokens,) if self.first else ()
            extra = {"target": labels, "losses": losses} if self.last else {}
            self.schedule.step(*inputs, **extra)
            return sum(float(x.detach()) for x in losses)
        total, mb = 0.0, self.args.micro_batch_size
        for i in range(self.num_micro):
            sl = slice(i * mb, (i + 1) * mb)
            sync = i == self.num_micro - 1 or self.module is self.model
            ctx = contextlib.nullcontext() if sync else self.module.no_sync()
            with ctx:
                loss = self.loss_fn(self.module(tokens[sl]), labels[sl]) / self.num_micro
                loss.backward()
            total += loss.item()
        return total

    def _clip(self) -> float:
        """Global gradient norm over the grid, each logical value counted once; clip in place."""
        from torch.distributed.tensor import DTensor, Shard
        sharded, replicated = torch.zeros(()), torch.zeros(())  # sums of squares
        grads = []
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad
            grads.append(g)
            if p is self.tied and self.last:
                continue  # the last stage's copy duplicates the first stage's embedding
            # a DTensor, or its local shard carrying the spec once DDP has localized it
            spec = g._spec if isinstance(g, DTensor) else getattr(p, "_st_info", None)
            local = g.to_local() if isinstance(g, DTensor) else g
            sq = torch.linalg.vector_norm(local, dtype=torch.float32) ** 2
            if spec is not None and any(isinstance(pl, Shard) for pl in spec.placements):
                sharded += sq
            else:
                replicated += sq
        if self.args.tp > 1:
            dist.all_reduce(sharded, group=self.mesh["tp"].get_group())
        total = sharded + replicated
        if self.args.pp > 1:
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        norm = math.sqrt(total.item())
        coef = self.args.clip_grad / (norm + 1e-6)
        if self.args.clip_grad > 0 and coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def step(self, k: int) -> dict:
        t0 = time.perf_counter()
        tokens, labels = self._local_batch(k)
        self.optimizer.zero_grad(set_to_none=True)
        local = self._forward_backward(tokens, labels)
        if self.tied_group is not None and self.tied.grad is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        norm = self._clip()
        lr = learning_rate(k, self.optim_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        owner = self.last and self.tp_rank == 0
        loss = torch.tensor([local if owner else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        dt = time.perf_counter() - t0
        tokens_step = self.args.global_batch_size * self.args.seq_length
        return {"step": k + 1, "loss": loss.item() / self.args.dp, "grad_norm": norm, "lr": lr,
                "tokens": tokens_step, "step_time_s": dt, "tokens_per_s": tokens_step / dt}


def main(argv=None) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    run = NativeRun(args)
    out = None
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        out = open(args.out, "w")
    try:
        for k in range(args.train_iters):
            record = run.step(k)
            if out is not None:
                out.write(json.dumps(record) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
        dist.barrier()
        dist.destroy_process_group()
    # every step is done and written: end the process here, without interpreter teardown, where
    # a gloo worker thread releasing a collective's tensors aborts it ("terminate called without
    # an active exception", SIGABRT; pytorch/pytorch#179291), seen with every schedule
    exit_now(0)


if __name__ == "__main__":
    sys.exit(main())
