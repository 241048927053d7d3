"""One optimizer step: forward and backward over the micro-batches (directly, or through the
pipeline executor when pp > 1), gradient reduction, overflow check, clipping and the update.

The order inside a step follows the mixed-precision recipe: scale the loss -> backward -> finish the
DP reduction -> sum the sequence-parallel and tied-embedding gradients -> unscale and check for
overflow, squared global norm (on the device) -> one all-reduce of the step's statistics over the
world and its one host read (``reduce_step_stats``; with a pipeline the phase's span is read just
before, from a max over the stage's ranks, for the measured bubble) -> an overflow anywhere in the
grid makes every rank skip -> clip the global norm -> optimizer step.

Timing: each part is bracketed by stamps of a ``DeviceClock`` on the device's stream (events on
CUDA/NPU), read after the step: ``time_forward_backward_s`` (the forward/backward phase, the
pipeline phase with pp > 1), ``time_dp_finish_s`` (finishing the DP gradient reduction: what the
backward did not hide), ``time_grad_sync_s`` (the sequence-parallel and tied-embedding
all-reduces), ``time_clip_s`` (unscale, overflow check, global norm, the statistics all-reduce and
clipping) and ``time_optimizer_s`` (the update, ZeRO's parameter all-gather included). They are
this rank's (the metrics carry global rank 0's): averaging them over ranks would need a second
collective after the update. The bubble is the world mean (it travels in the statistics). The
same spans, with every forward and backward (and with pp > 1 every transfer), are the step's
timeline events.

The statistics all-reduce is the step's one grid-wide agreement: besides the loss, the overflow
flag and the norm it sums the small integers of a ``StepAgreement`` (the checkpointer's stop and
save counters), so a decision every rank must take together costs no collective of its own. It
runs before the update, so that a step found bad (engine/observe/anomaly.py) can be run again from the
same state instead of being applied: ``run`` is ``compute`` (everything but the update), the
guard's review, then ``apply``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.device.clock import DeviceClock
from engine.training.loss_scaler import apply_grad_stats, grad_stats
from parallel.grads import sync_sequence_parallel_grads
from parallel.pipeline.bubble import COMPUTE_CATS, pipeline_bubble
from parallel.pipeline.executor import run_schedule, sum_embedding_grads
from parallel.pipeline.schedules import forward_only_schedule
from parallel.pipeline.timeline import TimelineEvent
from parallel.state import ParallelState

TIME_KEYS = ("time_forward_backward_s", "time_dp_finish_s", "time_grad_sync_s", "time_clip_s",
             "time_optimizer_s")
# the parts of a step after the forward/backward phase, in TIME_KEYS[1:]'s order: (timeline
# name, category)
_PHASES = (("DP finish", "dp"), ("grad sync", "grad_sync"), ("clip", "clip"),
           ("optimizer", "optimizer"))


@dataclass
class StepOutput:
    loss: float  # mean token loss over the global batch (valid on every rank)
    grad_norm: float | None
    skipped: bool
    loss_scale: float
    comm: dict  # per group kind: calls, payload_bytes, wire_bytes this step (parallel/comm.py)
    pipeline: object = None  # PipelineResult when pp > 1
    times: dict = field(default_factory=dict)  # TIME_KEYS: device seconds, mean over ranks
    marks: list = field(default_factory=list, repr=False)  # (name, cat, start, end, micro, chunk)
    extra: dict = field(default_factory=dict)
    rank: int = 0
    wall: object = field(default=None, repr=False)  # the clock's stamp -> epoch seconds
    _events: list | None = field(default=None, repr=False)

    @property
    def events(self) -> list:
        """This rank's TimelineEvents: the pipeline's actions and the step's phases (resolved on
        first read, by --timeline: a step that is not drawn converts no stamps)."""
        if self._events is None:
            events = list(self.pipeline.events) if self.pipeline is not None else []
            self._events = events + [TimelineEvent(self.rank, name, cat, self.wall(a), self.wall(b),
                                                   micro, chunk)
                                     for name, cat, a, b, micro, chunk in self.marks]
        return self._events


def mean_loss_over_grid(local_sum: float, ps: ParallelState, device,
                        holds_loss: bool | None = None) -> float:
    """The global-batch loss from one fp32 all-reduce over the world (HCCL reduces no float64):
    held by the ranks of tp rank 0 that run the last virtual stage (``holds_loss``; default the
    last pipeline rank), averaged over DP x CP."""
    if ps.world_size == 1:
        return local_sum
    owner = (ps.is_last_stage if holds_loss is None else holds_loss) and ps.tp_rank == 0
    t = torch.tensor([local_sum if owner else 0.0], dtype=torch.float32, device=device)
    ps.world_group.all_reduce(t)
    return t.item() / (ps.dp_size * ps.cp_size)


@dataclass
class StepStats:
    loss: float                  # mean token loss over the global batch
    found_inf: float             # > 0: some rank overflowed
    grad_norm_sq: float          # squared global gradient norm (after unscaling)
    per_rank: list[float]        # world means of the per-rank values
    per_stage: list[float]       # per-stage means of the per-stage values
    counts: list[float] = field(default_factory=list)  # world sums of the agreement's counts


class StepAgreement:
    """Small non-negative integers that every rank adds to the step's statistics all-reduce, summed
    over the world (exact in fp32 up to 2**24). Each source is ``fn() -> list[int]`` of a fixed
    width, called once per execution of the step; ``agreed[name]`` are the sums, identical on every
    rank. Example: the checkpointer's [stop requested, save written, save failed] on 4 ranks of
    which one got SIGTERM and all finished writing: [1, 4, 0]."""

    def __init__(self):
        self.sources: dict[str, tuple[int, object]] = {}

    def set(self, name: str, width: int, fn) -> None:
        self.sources[name] = (width, fn)

    def local(self) -> list[int]:
        out = []
        for name, (width, fn) in self.sources.items():
            values = [int(v) for v in fn()]
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


def _to_device(values: list[float], device) -> torch.Tensor:
    """Host floats as a device tensor without a host sync (pinned memory, asynchronous copy)."""
    t = torch.tensor(values, dtype=torch.float32)
    if torch.device(device).type in ("cpu", "meta") or not values:  # (meta: a dry run's)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def reduce_step_stats(ps: ParallelState, local_loss: torch.Tensor, grads: torch.Tensor,
                      per_rank: tuple[float, ...] = (),
                      per_stage: tuple[float, ...] = (), counts=(),
                      holds_loss: bool | None = None) -> StepStats:
    """The step's one collective and one host read: [loss, overflow flag, grad norm², per-rank
    values, per-stage values], summed over the world in fp32 (HCCL reduces no float64).

    ``local_loss``: this rank's loss (0-d device tensor), counted on the ranks of tp rank 0 that
    run the last virtual stage (``holds_loss``, as in ``mean_loss_over_grid``) and averaged over
    DP x CP. ``grads``: ``grad_stats(share=True)``'s (flag, this rank's share of the norm²); the
    flags are summed (> 0: an overflow somewhere), the shares add up to the grid-wide norm², so
    the norm needs no collective of its own. ``per_rank`` values (e.g. the idle fraction) are averaged over
    the world, ``per_stage`` ones (each rank fills its own stage's slots) over a stage's ranks;
    ``counts`` (small integers, a StepAgreement's) are summed.
    """
    device = grads.device
    owner = (ps.is_last_stage if holds_loss is None else holds_loss) and ps.tp_rank == 0
    zero = torch.zeros(1, dtype=torch.float32, device=device)
    parts = [local_loss.reshape(1).to(torch.float32) if owner else zero, grads]
    if per_rank or per_stage or counts:
        parts.append(_to_device([*per_rank, *per_stage, *counts], device))
    t = torch.cat(parts)
    ps.world_group.all_reduce(t)
    values = t.tolist()  # the step's one host sync
    k, j = 3 + len(per_rank), 3 + len(per_rank) + len(per_stage)
    ranks_per_stage = ps.world_size // ps.pp_size
    return StepStats(values[0] / (ps.dp_size * ps.cp_size), values[1], values[2],
                     [v / ps.world_size for v in values[3:k]],
                     [v / ranks_per_stage for v in values[k:j]], values[j:])


def micro_batch_loss(out: torch.Tensor, mb, num_micro: int, dp: int) -> torch.Tensor:
    """A micro-batch's share of the step's loss, from its per-token losses ``out`` (b, s).

    ``dp`` is the number of ranks the loss is averaged over: the DP x CP group (the reducer divides
    gradients by its size). Summed over the micro-batches of a rank and averaged over those ranks it
    gives the mean token loss of the global batch: ``mean / m`` per micro-batch (under context
    parallelism the mean of the rank's sequence shard, 1/cp of the tokens: the cp shard means
    average to the micro-batch's), or with a loss mask the sum of the unmasked losses over the
    global batch's unmasked token count, times dp x cp.
    """
    if mb.loss_mask is None:
        return out.mean() / num_micro
    return (out * mb.loss_mask).sum() * (dp / max(mb.loss_tokens, 1))




def stage_compute_times(events, ps: ParallelState) -> tuple[float, ...]:
    """(mean forward s, mean backward s, mean W s) of this rank, in its stage's slots of a 3*pp
    vector (W 0.0 in schedules without W actions)."""
    k = len(COMPUTE_CATS)
    slots = [0.0] * (k * ps.pp_size)
    for j, cat in enumerate(COMPUTE_CATS):
        spans = [e.end - e.start for e in events if e.cat == cat]
        slots[k * ps.pp_rank + j] = sum(spans) / len(spans) if spans else 0.0
    return tuple(slots)


@dataclass
class Computed:
    """One execution of a step up to (not including) the update."""
    loss: float
    check: object            # engine.training.loss_scaler.StepCheck
    scale: float
    pipe: object
    stats: StepStats
    agreed: dict             # StepAgreement sums by source name
    snapshot: dict           # communication counters at the start
    stamps: list             # DeviceClock stamps: start, after forward/backward, DP finish, grad sync, statistics
    marks: list              # pp=1 forward/backward marks (name, cat, start, end, micro, chunk)


class Stepper:
    """Holds what a step needs; ``run(batches, lr)`` performs one optimizer step."""

    def __init__(self, ps: ParallelState, chunks, reducer, optimizer, scaler, clip_grad: float,
                 schedule_actions=None, act_shape=None, act_dtype=torch.float32,
                 timeout_s: float = 300.0, overflow=None, waiter=None,
                 clock: DeviceClock | None = None, placement: str = "loop",
                 weight_grads=None, scatter_gather: bool = False):
        """``overflow``: the device module's ``overflow_check()`` (the float status register on a
        saturation-mode NPU), None elsewhere; ``waiter``: ``p2p.waiter_for(backend)``; ``clock``:
        the device timing API (engine/device/clock.py); ``placement``: of the chunks on pipeline ranks;
        ``weight_grads``: the ``WeightGradStore`` the chunks' layers use under a schedule with W
        actions; ``scatter_gather``: split stage boundary tensors over TP (exchange.py)."""
        self.ps, self.chunks, self.reducer = ps, chunks, reducer
        self.optimizer, self.scaler, self.clip_grad = optimizer, scaler, clip_grad
        self.actions, self.act_shape, self.act_dtype = schedule_actions, act_shape, act_dtype
        self.timeout_s, self.overflow, self.waiter = timeout_s, overflow, waiter
        self.clock = clock or DeviceClock(ps.device.type)
        self.placement, self.weight_grads, self.scatter_gather = placement, weight_grads, scatter_gather
        seen: set[int] = set()
        self.params = [p for c in chunks for p in c.parameters()
                       if id(p) not in seen and not seen.add(id(p))]
        self.shared = [p for c in chunks for p in c.shared_embedding_params()]
        self.holds_loss = any(c.post_process for c in chunks)  # runs the last virtual stage
        self.agreement = StepAgreement()
        self.agreed: dict = {}          # the last step's agreed counts, by source
        self.guard = None               # engine.observe.anomaly.AnomalyGuard: reviews a step before its update
        self.current_step = None        # the step being run (1-based), as the trainer names it
        self.micro_losses = None        # this rank's per-micro-batch losses of the last execution (device)

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
            return micro_batch_loss(out, mb, m, self.ps.dp_cp_group.size) * scale
        return forward_step

    def _forward_backward(self, batches: list, scale: float, marks: list | None = None):
        """``batches``: this rank's micro-batches (engine.data.packing.MicroBatch). Returns this
        rank's loss as a 0-d device tensor (not read here) and the pipeline result; with pp=1 the
        forwards and backwards are appended to ``marks`` as (name, cat, start, end, micro, chunk)."""
        m = len(batches)
        marks = [] if marks is None else marks
        self.reducer.set_num_microbatches(m)  # a parameter's m-th accumulation launches its bucket
        if self.ps.pp_size == 1:
            model, losses, stamp = self.chunks[0], [], self.clock.stamp
            for i, mb in enumerate(batches):
                a = stamp()
                loss = micro_batch_loss(model(mb.tokens, mb.labels, mb.inputs), mb, m,
                                        self.ps.dp_cp_group.size)
                b = stamp()
                (loss * scale).backward()
                marks += [(f"F{i}", "forward", a, b, i, 0), (f"B{i}", "backward", b, stamp(), i, 0)]
                losses.append(loss.detach())
            self.micro_losses = torch.stack(losses)
            return self.micro_losses.sum(), None
        result = run_schedule(self.ps, self.actions, list(self.chunks),
                              self._forward_step(batches, scale), m, self.act_shape,
                              self.act_dtype, self.timeout_s, waiter=self.waiter, clock=self.clock,
                              placement=self.placement, weight_grads=self.weight_grads,
                              scatter_gather=self.scatter_gather)
        self.micro_losses = result.loss_values
        local = result.loss_sum
        if local is None:  # not the last stage: its loss slot is not counted
            return torch.zeros((), dtype=torch.float32, device=batches[0].tokens.device), result
        return local / scale, result

    def statistics(self, local_loss: torch.Tensor, pipe):
        """After the gradients are complete: unscale and check for overflow, the squared norm, the
        bubble, the step's one statistics all-reduce, then skip or clip. Returns (StepStats,
        StepCheck). Reading the pipeline's events waits for the device: it comes after the
        gradient checks are queued."""
        grads = grad_stats(self.optimizer, self.scaler, self.overflow, share=True)
        per_rank, stage_times = (), ()
        if pipe is not None:
            with self.ps.comm.uncounted():  # the phase's span: not traffic of the step
                per_rank = (pipeline_bubble(self.ps, pipe.events),)
            stage_times = stage_compute_times(pipe.events, self.ps)
        stats = reduce_step_stats(self.ps, local_loss, grads, per_rank, stage_times,
                                  self.agreement.local(), self.holds_loss)
        check = apply_grad_stats(self.optimizer, self.scaler, stats.found_inf, stats.grad_norm_sq,
                                 self.clip_grad, self.reducer)
        return stats, check

    def run(self, batches, lr: float, step: int | None = None) -> StepOutput:
        """One optimizer step over this rank's micro-batches; ``step`` (1-based) names it in
        anomaly reports (default: ``current_step``, set by the trainer). With a guard, a step found
        bad is reviewed (run again) before any update."""
        if step is not None:
            self.current_step = step
        self.clock.anchor()  # synchronize: the step starts on an idle device
        if self.guard is not None:
            self.guard.before(self)
        pre = self.compute(batches)
        if self.guard is not None:
            pre = self.guard.review(self, batches, pre, self.current_step)
        return self.apply(pre, lr)

    def compute(self, batches) -> Computed:
        """Forward and backward, the gradient reductions and checks, and the statistics all-reduce:
        everything of a step but the update, which leaves parameters and optimizer state alone."""
        clock, marks = self.clock, []
        snapshot = self.ps.comm.snapshot()
        self.optimizer.zero_grad()
        if self.weight_grads is not None:
            self.weight_grads.clear()  # nothing queued survives a step (e.g. one that raised)
        if self.overflow is not None:
            self.overflow.clear()
        scale = float(self.scaler.scale)
        t = [clock.stamp()]
        local_loss, pipe = self._forward_backward(batches, scale, marks)
        t.append(clock.stamp())
        self.reducer.finish()
        t.append(clock.stamp())
        sync_sequence_parallel_grads(self.params, self.ps)
        sum_embedding_grads(self.ps, self.shared)
        t.append(clock.stamp())
        stats, check = self.statistics(local_loss, pipe)
        t.append(clock.stamp())
        return Computed(stats.loss, check, scale, pipe, stats, self.agreement.split(stats.counts),
                        snapshot, t, marks)

    def apply(self, pre: Computed, lr: float) -> StepOutput:
        """The update of a computed step (none when it is skipped), then its figures."""
        clock, t, marks = self.clock, list(pre.stamps), list(pre.marks)
        if not pre.check.skipped:
            self.optimizer.step(lr)
        t.append(clock.stamp())
        self.agreed = pre.agreed
        comm = self.ps.comm.since(pre.snapshot)
        marks += [(name, cat, t[i + 1], t[i + 2], -1, 0) for i, (name, cat) in enumerate(_PHASES)]
        times = [clock.elapsed_s(t[i], t[i + 1]) for i in range(len(t) - 1)]
        out = StepOutput(pre.loss, pre.check.grad_norm, pre.check.skipped, pre.scale, comm, pre.pipe,
                         dict(zip(TIME_KEYS, times)), marks, rank=self.ps.rank, wall=clock.timebase())
        if pre.pipe is not None:
            out.extra["bubble_measured"] = pre.stats.per_rank[0]
            k = len(COMPUTE_CATS)
            out.extra["stage_fwd_s"] = pre.stats.per_stage[0::k]
            out.extra["stage_bwd_s"] = pre.stats.per_stage[1::k]
            out.extra["stage_wgt_s"] = pre.stats.per_stage[2::k]
        return out

    @torch.no_grad()
    def forward_only(self, batches) -> float:
        """Mean loss of these micro-batches over the grid, without gradients (validation)."""
        m = len(batches)
        device, dp = batches[0].tokens.device, self.ps.dp_cp_group.size
        if self.ps.pp_size == 1:
            model = self.chunks[0]
            if batches[0].loss_mask is None:
                local = sum(model(mb.tokens, mb.labels, mb.inputs).mean().item() for mb in batches) / m
            else:
                local = sum(micro_batch_loss(model(mb.tokens, mb.labels, mb.inputs), mb, m, dp).item()
                            for mb in batches)
            return mean_loss_over_grid(local, self.ps, device)
        actions = forward_only_schedule(self.ps.pp_size, m, len(self.chunks), self.placement)
        self.clock.anchor()
        result = run_schedule(self.ps, actions, list(self.chunks), self._forward_step(batches, 1.0),
                              m, self.act_shape, self.act_dtype, self.timeout_s, clock=self.clock,
                              deallocate_outputs=False, forward_only=True,
                              scatter_gather=self.scatter_gather)
        return mean_loss_over_grid(sum(result.losses), self.ps, device, holds_loss=self.holds_loss)
