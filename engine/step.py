"""One optimizer step: forward and backward over the micro-batches (directly, or through the
pipeline executor when pp > 1), gradient reduction, overflow check, clipping and the update.

The order inside a step follows the mixed-precision recipe: scale the loss -> backward -> finish the
DP reduction -> sum the sequence-parallel and tied-embedding gradients -> an overflow anywhere in the
grid makes every rank skip -> unscale -> clip the global norm -> the step's statistics all-reduce ->
optimizer step.

The statistics all-reduce (``step_statistics``) is the step's one grid-wide agreement: besides the
loss and the timing figures it sums the small integers of a ``StepAgreement`` (the checkpointer's
stop and save counters, the anomaly guard's verdicts), so a decision every rank must take together
costs no collective of its own. It runs before the update, so that a step found bad (engine/
anomaly.py) can be run again from the same state instead of being applied.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.loss_scaler import unscale_and_check
from parallel.grads import sync_sequence_parallel_grads
from parallel.pipeline.executor import run_schedule, sum_embedding_grads
from parallel.pipeline.schedules import forward_only_schedule
from parallel.state import ParallelState


@dataclass
class StepOutput:
    loss: float  # mean token loss over the global batch (valid on every rank)
    grad_norm: float | None
    skipped: bool
    loss_scale: float
    comm: dict  # per group kind: calls, payload_bytes, wire_bytes this step (parallel/comm.py)
    pipeline: object = None  # PipelineResult when pp > 1
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


class StepAgreement:
    """Small non-negative integers that every rank adds to the step's statistics all-reduce, summed
    over the world (exact in fp32 up to 2**24). Each source is ``fn(check) -> list[int]`` of a
    fixed width, called once per execution of the step after the gradient check; ``agreed[name]``
    are the sums, identical on every rank. Example: the checkpointer's [stop requested, save
    written, save failed] on 4 ranks of which one got SIGTERM and all finished writing: [1, 4, 0]."""

    def __init__(self):
        self.sources: dict[str, tuple[int, object]] = {}

    def set(self, name: str, width: int, fn) -> None:
        self.sources[name] = (width, fn)

    def local(self, check) -> list[int]:
        out = []
        for name, (width, fn) in self.sources.items():
            values = [int(v) for v in fn(check)]
            if len(values) != width or min(values, default=0) < 0:
                raise ValueError(f"StepAgreement: {name} must give {width} non-negative integers, "
                                 f"got {values}")
            out += values
        return out

    def split(self, values) -> dict[str, list[int]]:
        out, k = {}, 0
        for name, (width, _) in self.sources.items():
            out[name] = [int(round(v)) for v in values[k:k + width]]
            k += width
        return out


@dataclass
class StepStats:
    loss: float              # mean token loss over the global batch
    per_rank: list[float]    # world means of the per-rank values
    per_stage: list[float]   # per-stage means of the per-stage values
    counts: list[float]      # world sums of the counts


def step_statistics(local_sum: float, ps: ParallelState, device, per_rank: tuple[float, ...] = (),
                    per_stage: tuple[float, ...] = (), counts=()) -> StepStats:
    """One all-reduce over the world for a step's statistics: the global-batch loss (held by
    last-stage ranks of tp rank 0, averaged over DP), the world mean of ``per_rank`` values (e.g. the
    idle fraction), the per-pipeline-stage mean of ``per_stage`` values (each rank fills only
    its own stage's slots, e.g. mean forward and backward times) and the world sum of ``counts``
    (small integers). fp32: HCCL reduces no float64."""
    if ps.world_size == 1:
        return StepStats(local_sum, list(per_rank), list(per_stage), [float(c) for c in counts])
    owner = ps.is_last_stage and ps.tp_rank == 0
    t = torch.tensor([local_sum if owner else 0.0, *per_rank, *per_stage, *counts],
                     dtype=torch.float32, device=device)
    ps.world_group.all_reduce(t)
    values = t.tolist()
    ranks_per_stage = ps.tp_size * ps.dp_size
    k, j = 1 + len(per_rank), 1 + len(per_rank) + len(per_stage)
    return StepStats(values[0] / ps.dp_size, [v / ps.world_size for v in values[1:k]],
                     [v / ranks_per_stage for v in values[k:j]], values[j:])


def mean_loss_over_grid(local_sum: float, ps: ParallelState, device,
                        per_rank: tuple[float, ...] = (),
                        per_stage: tuple[float, ...] = ()) -> tuple[float, list[float], list[float]]:
    """``step_statistics`` without counts, as (loss, per-rank means, per-stage means)."""
    stats = step_statistics(local_sum, ps, device, per_rank, per_stage)
    return stats.loss, stats.per_rank, stats.per_stage


def micro_batch_loss(out: torch.Tensor, mb, num_micro: int, dp: int) -> torch.Tensor:
    """A micro-batch's share of the step's loss, from its per-token losses ``out`` (b, s).

    Summed over the micro-batches of a rank and averaged over DP (the reducer divides gradients by
    dp) it gives the mean token loss of the global batch: ``mean / m`` per micro-batch, or with a
    loss mask the sum of the unmasked losses over the global batch's unmasked token count, times dp.
    """
    if mb.loss_mask is None:
        return out.mean() / num_micro
    return (out * mb.loss_mask).sum() * (dp / max(mb.loss_tokens, 1))


@dataclass
class Computed:
    """One execution of a step up to (not including) the update."""
    loss: float
    check: object            # engine.loss_scaler.StepCheck
    scale: float
    pipe: object
    stats: StepStats
    agreed: dict             # StepAgreement sums by source name
    snapshot: dict           # communication counters at the start
    t0: float


def stage_compute_times(events, ps: ParallelState) -> tuple[float, ...]:
    """(mean forward s, mean backward s) of this rank, in its stage's slots of a 2*pp vector."""
    slots = [0.0] * (2 * ps.pp_size)
    for j, cat in enumerate(("forward", "backward")):
        spans = [e.end - e.start for e in events if e.cat == cat]
        slots[2 * ps.pp_rank + j] = sum(spans) / len(spans) if spans else 0.0
    return tuple(slots)


class Stepper:
    """Holds what a step needs; ``run(batches, lr)`` performs one optimizer step."""

    def __init__(self, ps: ParallelState, chunks, reducer, optimizer, scaler, clip_grad: float,
                 schedule_actions=None, act_shape=None, act_dtype=torch.float32,
                 timeout_s: float = 300.0):
        self.ps, self.chunks, self.reducer = ps, chunks, reducer
        self.optimizer, self.scaler, self.clip_grad = optimizer, scaler, clip_grad
        self.actions, self.act_shape, self.act_dtype = schedule_actions, act_shape, act_dtype
        self.timeout_s = timeout_s
        self.params = [p for c in chunks for p in c.parameters()]
        self.shared = [p for c in chunks for p in c.shared_embedding_params()]
        self.agreement = StepAgreement()
        self.agreed: dict = {}          # the last step's agreed counts, by source
        self.guard = None               # engine.anomaly.AnomalyGuard: reviews a step before its update
        self.current_step = None        # the step being run (1-based), as the trainer names it
        self.micro_losses = None        # this rank's per-micro-batch losses of the last execution

    def _forward_step(self, batches, scale: float):
        """The executor's callback: a chunk's output, or on the last chunk the scaled mean loss."""
        m = len(batches)

        def forward_step(chunk_idx, micro_idx, x):
            mb = batches[micro_idx]
            chunk = self.chunks[chunk_idx]
            out = chunk(mb.tokens if x is None else x, mb.labels if chunk.post_process else None,
                        mb.inputs)
            if not chunk.post_process:
                return out
            return micro_batch_loss(out, mb, m, self.ps.dp_size) * scale
        return forward_step

    def _forward_backward(self, batches: list, scale: float):
        """``batches``: this rank's micro-batches (engine.data.packing.MicroBatch)."""
        m = len(batches)
        self.reducer.set_num_microbatches(m)  # a parameter's m-th accumulation launches its bucket
        if self.ps.pp_size == 1:
            model, losses = self.chunks[0], []
            for mb in batches:
                loss = micro_batch_loss(model(mb.tokens, mb.labels, mb.inputs), mb, m,
                                        self.ps.dp_size)
                (loss * scale).backward()
                losses.append(loss.detach())
            self.micro_losses = torch.stack(losses)
            return self.micro_losses.sum().item(), None
        result = run_schedule(self.ps, self.actions, list(self.chunks),
                              self._forward_step(batches, scale), m, self.act_shape,
                              self.act_dtype, self.timeout_s)
        self.micro_losses = torch.tensor(result.losses) if result.losses else None
        return sum(result.losses) / scale, result

    def run(self, batches, lr: float, step: int | None = None) -> StepOutput:
        """One optimizer step over this rank's micro-batches; ``step`` (1-based) names it in
        anomaly reports (default: ``current_step``, set by the trainer). With a guard, a step found
        bad is reviewed (re-run) before any update."""
        if step is not None:
            self.current_step = step
        step = self.current_step
        if self.guard is not None:
            self.guard.before(self)
        pre = self.compute(batches)
        if self.guard is not None:
            pre = self.guard.review(self, batches, pre, step)
        return self.apply(pre, lr)

    def compute(self, batches) -> Computed:
        """Forward and backward, the gradient reductions and check, and the statistics all-reduce:
        everything of a step but the update, which leaves parameters and optimizer state alone."""
        t0 = time.perf_counter()
        snapshot = self.ps.comm.snapshot()
        self.optimizer.zero_grad()
        scale = float(self.scaler.scale)
        local_loss, pipe = self._forward_backward(batches, scale)
        self.reducer.finish()
        sync_sequence_parallel_grads(self.params, self.ps)
        sum_embedding_grads(self.ps, self.shared)
        check = unscale_and_check(self.optimizer, self.scaler, self.clip_grad, self.reducer)
        idle, stage_times = (), ()
        if pipe is not None:  # this rank's idle fraction: not computing a forward or backward
            busy = sum(e.end - e.start for e in pipe.events if e.cat in ("forward", "backward"))
            idle = (max(0.0, 1.0 - busy / pipe.wall_s) if pipe.wall_s > 0 else 0.0,)
            stage_times = stage_compute_times(pipe.events, self.ps)
        stats = step_statistics(local_loss, self.ps, batches[0].tokens.device, idle, stage_times,
                                self.agreement.local(check))
        return Computed(stats.loss, check, scale, pipe, stats, self.agreement.split(stats.counts),
                        snapshot, t0)

    def apply(self, pre: Computed, lr: float) -> StepOutput:
        """The update of a computed step (none when it is skipped)."""
        if not pre.check.skipped:
            self.optimizer.step(lr)
        self.agreed = pre.agreed
        comm = self.ps.comm.since(pre.snapshot)
        out = StepOutput(pre.loss, pre.check.grad_norm, pre.check.skipped, pre.scale, comm, pre.pipe,
                         time.perf_counter() - pre.t0)
        if pre.pipe is not None:
            out.extra["bubble_measured"] = pre.stats.per_rank[0]
            stage_mean = pre.stats.per_stage
            out.extra["stage_fwd_s"], out.extra["stage_bwd_s"] = stage_mean[0::2], stage_mean[1::2]
        return out

    @torch.no_grad()
    def forward_only(self, batches) -> float:
        """Mean loss of these micro-batches over the grid, without gradients (validation)."""
        m = len(batches)
        device, dp = batches[0].tokens.device, self.ps.dp_size
        if self.ps.pp_size == 1:
            model = self.chunks[0]
            if batches[0].loss_mask is None:
                local = sum(model(mb.tokens, mb.labels, mb.inputs).mean().item() for mb in batches) / m
            else:
                local = sum(micro_batch_loss(model(mb.tokens, mb.labels, mb.inputs), mb, m, dp).item()
                            for mb in batches)
            return mean_loss_over_grid(local, self.ps, device)[0]
        actions = forward_only_schedule(self.ps.pp_size, m, len(self.chunks))
        result = run_schedule(self.ps, actions, list(self.chunks), self._forward_step(batches, 1.0),
                              m, self.act_shape, self.act_dtype, self.timeout_s,
                              deallocate_outputs=False, forward_only=True)
        return mean_loss_over_grid(sum(result.losses), self.ps, device)[0]
