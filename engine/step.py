"""One optimizer step: forward and backward over the micro-batches (directly, or through the
pipeline executor when pp > 1), gradient reduction, overflow check, clipping and the update.

The order inside a step follows the mixed-precision recipe: scale the loss -> backward -> finish the
DP reduction -> sum the sequence-parallel and tied-embedding gradients -> an overflow anywhere in the
grid makes every rank skip -> unscale -> clip the global norm -> optimizer step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.grad_norm import clip_grads, found_inf
from parallel.pipeline.executor import run_schedule, sum_embedding_grads
from parallel.state import ParallelState
from parallel.tensor_parallel.mappings import group_size


@dataclass
class StepOutput:
    loss: float  # mean token loss over the global batch (valid on every rank)
    grad_norm: float | None
    skipped: bool
    loss_scale: float
    dp_comm: dict
    pipeline: object = None  # PipelineResult when pp > 1
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def sync_sequence_parallel_grads(params: list[torch.nn.Parameter], ps: ParallelState) -> None:
    """Norm weights under sequence parallelism saw only a sequence shard: sum their grads over TP."""
    if group_size(ps.tp_group) == 1:
        return
    grads = [_grad(p) for p in params if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ps.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def _grad(p):
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def mean_loss_over_grid(local_sum: float, ps: ParallelState, device) -> float:
    """The global-batch loss: summed on last-stage ranks of tp rank 0, averaged over DP, on all ranks."""
    if ps.world_size == 1:
        return local_sum
    owner = ps.is_last_stage and ps.tp_rank == 0
    t = torch.tensor([local_sum if owner else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / ps.dp_size


class Stepper:
    """Holds what a step needs; ``run(batches, lr)`` performs one optimizer step."""

    def __init__(self, ps: ParallelState, chunks, reducer, optimizer, scaler, clip_grad: float,
                 schedule_actions=None, act_shape=None, act_dtype=torch.float32,
                 timeout_s: float = 300.0, recorder=None):
        self.ps, self.chunks, self.reducer = ps, chunks, reducer
        self.optimizer, self.scaler, self.clip_grad = optimizer, scaler, clip_grad
        self.actions, self.act_shape, self.act_dtype = schedule_actions, act_shape, act_dtype
        self.timeout_s, self.recorder = timeout_s, recorder
        self.params = [p for c in chunks for p in c.parameters()]
        self.shared = [p for c in chunks for p in c.shared_embedding_params()]
        self.dynamic_scale = not getattr(scaler, "constant", False)

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        m = len(batches)
        if self.ps.pp_size == 1:
            model, total = self.chunks[0], 0.0
            for i, (tokens, labels) in enumerate(batches):
                self.reducer.set_last_microbatch(i == m - 1)
                loss = model(tokens, labels).mean() / m
                (loss * scale).backward()
                total += loss.item()
            return total, None

        def forward_step(chunk_idx, micro_idx, x):
            tokens, labels = batches[micro_idx]
            chunk = self.chunks[chunk_idx]
            out = chunk(tokens if x is None else x, labels if chunk.post_process else None)
            return out.mean() / m * scale if chunk.post_process else out

        def before_backward(chunk_idx, micro_idx, is_last):
            self.reducer.set_last_microbatch(is_last)

        result = run_schedule(self.ps, self.actions, list(self.chunks), forward_step, m,
                              self.act_shape, self.act_dtype, self.timeout_s,
                              recorder=self.recorder, before_backward=before_backward)
        return sum(result.losses) / scale, result

    def run(self, batches, lr: float) -> StepOutput:
        t0 = time.perf_counter()
        self.reducer.zero_grad()
        scale = float(self.scaler.scale)
        local_loss, pipe = self._forward_backward(batches, scale)
        self.reducer.finish()
        sync_sequence_parallel_grads(self.params, self.ps)
        sum_embedding_grads(self.ps, self.shared)
        overflow = found_inf(self.params, self.ps) if self.dynamic_scale else False
        skipped = self.scaler.update(overflow)
        grad_norm = None
        if not skipped:
            if scale != 1.0:
                self.optimizer.unscale_(1.0 / scale)
            grad_norm = clip_grads(self.params, self.clip_grad, self.ps) if self.clip_grad > 0 else None
            self.optimizer.step(lr)
        loss = mean_loss_over_grid(local_loss, self.ps, batches[0][0].device)
        return StepOutput(loss, grad_norm, bool(skipped), scale, self.reducer.stats(), pipe,
                          time.perf_counter() - t0)
