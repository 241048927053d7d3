"""One optimizer step: forward and backward over the micro-batches (directly, or through the
pipeline executor when pp > 1), gradient reduction, overflow check, clipping and the update.

The order inside a step follows the mixed-precision recipe: scale the loss -> backward -> finish the
DP reduction -> sum the sequence-parallel and tied-embedding gradients -> unscale and check for
overflow, squared global norm (on the device) -> one all-reduce of the step's statistics over the
world and its one host read (``reduce_step_stats``, engine/training/step_stats.py; with a pipeline
it carries the previous step's bubble) -> an overflow anywhere in the grid makes every rank skip
-> clip the global norm -> optimizer step.

Host waits: a step waits for the device once, at the statistics read (``DeviceClock.read``,
counted by engine/device/syncs.py); nothing waits before the forward, so ZeRO's parameter
all-gathers queued by the previous update overlap this step's first forwards and the device keeps
working while the host collates. The read comes before the update because the skip decision and
the clipping coefficient are taken on the host (a device-side skip would have to mask every
optimizer write and the scaler's state); scalars the update needs on the host (the optimizer's
``host_reads``) come along in the same read. What runs after it is read at the next step's wait
(engine/training/late_figures.py): ``time_clip_s``, ``time_optimizer_s`` and, with a pipeline,
the measured bubble and the per-stage means, which ride on the next step's all-reduce.
``StepOutput.complete`` says when they are in; ``Stepper.flush`` reads the last step's.

Timing: each part is bracketed by stamps of a ``DeviceClock`` on the device's stream (events on
CUDA/NPU), read at the step's wait (the clipping's and the update's at the next one):
``time_forward_backward_s`` (the forward/backward phase, the
pipeline phase with pp > 1), ``time_dp_finish_s`` (finishing the DP gradient reduction: what the
backward did not hide), ``time_grad_sync_s`` (the sequence-parallel and tied-embedding
all-reduces), ``time_clip_s`` (unscale, overflow check, global norm, the statistics all-reduce and
clipping) and ``time_optimizer_s`` (the update, ZeRO's parameter all-gather included); beside
them ``time_dp_exposed_s`` (the reducer's wait for collectives still in flight, inside the DP
finish) and ``time_zero_gather_exposed_s`` (the step's waits for ZeRO's overlapped parameter
gathers; null without the overlap), from stamps the reducer and the gather take on the same
clock. They are this rank's (the metrics carry global rank 0's): averaging them over ranks would
need a second collective after the update. The bubble is the world mean (it travels in the statistics). The
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
from engine.training.late_figures import LateFigures
from engine.training.loss_scaler import apply_grad_stats, grad_stats
from engine.training.step_stats import (StepAgreement, StepStats, mean_loss_over_grid,  # noqa: F401
                                        reduce_step_stats)
from models.moe.stats import set_aux_grad_scale
from models.moe.step_figures import StepFigures, update_expert_bias
from parallel.grads.main_grad import sync_sequence_parallel_grads
from parallel.pipeline.bubble import COMPUTE_CATS, phase_times
from parallel.pipeline.executor import run_schedule, sum_embedding_grads
from parallel.pipeline.schedules import forward_only_schedule
from parallel.pipeline.timeline import TimelineEvent
from parallel.grid.state import ParallelState

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
    comm: dict  # per group kind: calls, payload_bytes, wire_bytes this step (runtime/comm.py)
    pipeline: object = None  # PipelineResult when pp > 1
    times: dict = field(default_factory=dict)  # TIME_KEYS: device seconds, mean over ranks
    marks: list = field(default_factory=list, repr=False)  # (name, cat, start, end, micro, chunk)
    extra: dict = field(default_factory=dict)
    rank: int = 0
    wall: object = field(default=None, repr=False)  # the clock's stamp -> epoch seconds
    complete: bool = False  # the late figures (time_optimizer_s, the bubble) are in
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


def exposed_times(clock, waits: dict) -> dict:
    """``time_dp_exposed_s`` (the DP reduction's wait for its collectives in flight after the
    backward, parallel/dp/reducer.py ``finish``), with tp > 1 ``time_tp_exposed_s`` (every
    interval the step spent blocked in a TP-group collective or in the wait for one: the
    layers' all-gathers, reduce-scatters and all-reduces, the --tp-comm-overlap ring's waits,
    the vocabulary-parallel loss's and the sequence-parallel gradients' all-reduces; stamped by
    the rank's comm Activity) and, under ZeRO with overlapped parameter
    gathers, ``time_zero_gather_exposed_s`` (the step's waits for them, param_gather.py; under
    ZeRO-3 the backward's re-gathers too, zero3.py): device seconds between stamp pairs taken
    before the step's wait, so reading them waits for nothing. A wait that had nothing in flight
    left no stamps and counts 0.0; None: no such wait (no ZeRO gather, or a synchronous one)."""
    return {key: None if pairs is None else
            sum((clock.elapsed_s(a, b) for a, b in (p for p in pairs if p is not None)), 0.0)
            for key, pairs in waits.items()}


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
    wall: object = None      # the clock's timebase taken before the step's first stamp
    phase: object = None     # pp > 1: this rank's PhaseTimes, read after the statistics wait
    stage_times: tuple = ()  # pp > 1: this rank's compute means in its stage's slots
    spans: list | None = None  # pp > 1: this rank's transfer spans (parallel/pipeline/transfers.py)
    waits: dict = field(default_factory=dict)  # exposed-time stamp pairs (see exposed_times)

    def after(self, first: "Computed") -> "Computed":
        """This execution, a re-run of the step ``first`` computed, with the figures of both:
        the traffic counted since ``first`` began, the time from its first stamp, and the
        exposed waits of both executions (a figure neither had stays None)."""
        self.snapshot = first.snapshot
        self.stamps[0] = first.stamps[0]
        self.waits = {key: None if pairs is None and first.waits.get(key) is None
                      else list(first.waits.get(key) or []) + list(pairs or [])
                      for key, pairs in self.waits.items()}
        return self
    moe: dict | None = None  # the step's MoE figures (models/moe/step_figures.py), None without MoE


class Stepper:
    """Holds what a step needs; ``run(batches, lr)`` performs one optimizer step."""

    def __init__(self, ps: ParallelState, chunks, reducer, optimizer, scaler, clip_grad: float,
                 schedule_actions=None, act_shape=None, act_dtype=torch.float32,
                 timeout_s: float = 300.0, overflow=None, waiter=None,
                 clock: DeviceClock | None = None, placement: str = "loop",
                 weight_grads=None, scatter_gather: bool = False, schedule_lists=None):
        """``overflow``: the device module's ``overflow_check()`` (the float status register on a
        saturation-mode NPU), None elsewhere; ``waiter``: ``p2p.waiter_for(backend)``; ``clock``:
        the device timing API (engine/device/clock.py); ``placement``: of the chunks on pipeline ranks;
        ``weight_grads``: the ``WeightGradStore`` the chunks' layers use under a schedule with W
        actions; ``scatter_gather``: split stage boundary tensors over TP (exchange.py);
        ``schedule_lists``: the whole schedule (every rank's program), for the transfers'
        figures (time_pp_exposed_s and the replay with transfers)."""
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
        self.late: LateFigures | None = None  # the last step's figures read at the next wait
        self.moe = StepFigures.of(chunks)  # MoE figures: read at the statistics' one wait
        self.moe_figures: dict | None = None
        self.num_micro = 1
        self.schedule_lists = schedule_lists
        self.param_gather = getattr(optimizer, "param_gather", None)  # ZeRO's
        for timed in (reducer, self.param_gather):  # their waits, stamped for the exposed times
            if timed is not None:
                timed.clock = self.clock
        self.tp_waits = None  # with tp > 1: the TP group's blocked intervals (time_tp_exposed_s)
        if ps.tp_size > 1:
            activity = ps.comm.activity
            self.tp_waits = activity.watched.setdefault("tp", [])
            activity.watch_clock = self.clock
        if self.clock._anchor is None:  # the first timebase; later steps move it at their wait
            self.clock.anchor()

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
        m = self.num_micro = len(batches)
        marks = [] if marks is None else marks
        self.reducer.set_num_microbatches(m)  # a parameter's m-th accumulation launches its bucket
        set_aux_grad_scale(self.chunks, scale / m)  # MoE balancing losses weigh like the token loss
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

    def _moe_sums(self, device) -> tuple:
        """The MoE figures (models/moe/step_figures.py) summed over the world, on the device: an
        all-reduce of their own, read along with the statistics."""
        if self.moe is None:
            return ()
        v = self.moe.vector(self.chunks, self.num_micro, self.ps.tp_rank == 0, device)
        if self.ps.world_size > 1:
            self.ps.world_group.all_reduce(v)
        return tuple(v.unbind())

    def statistics(self, local_loss: torch.Tensor, pipe):
        """After the gradients are complete: unscale and check for overflow, the squared norm, the
        previous step's bubble, the step's one statistics all-reduce and its one wait, then skip
        or clip. Returns (StepStats, StepCheck)."""
        grads = grad_stats(self.optimizer, self.scaler, self.overflow, share=True)
        per_rank, stage_times = (), ()
        if self.late is not None:
            with self.ps.comm.uncounted():  # the phase's span: not traffic of the step
                per_rank, stage_times = self.late.carried(self.ps)
        wanted = getattr(self.optimizer, "host_reads", None)  # scalars the update reads on the host
        local = wanted(grads.device) if wanted is not None else []
        n_local, moe = len(local), self._moe_sums(grads.device)
        stats = reduce_step_stats(self.ps, local_loss, grads, per_rank, stage_times,
                                  self.agreement.local(), self.holds_loss, clock=self.clock,
                                  local=[*local, *moe])
        if moe:  # read with the statistics (the step's one wait)
            self.moe_figures = self.moe.read(stats.local[n_local:], self.ps.dp_cp_group.size)
            stats.local = stats.local[:n_local]
        if wanted is not None:
            self.optimizer.host_values(stats.local)
        check = apply_grad_stats(self.optimizer, self.scaler, stats.found_inf, stats.grad_norm_sq,
                                 self.clip_grad, self.reducer)
        return stats, check

    def run(self, batches, lr: float, step: int | None = None) -> StepOutput:
        """One optimizer step over this rank's micro-batches; ``step`` (1-based) names it in
        anomaly reports (default: ``current_step``, set by the trainer). With a guard, a step found
        bad is reviewed (run again) before any update."""
        if step is not None:
            self.current_step = step
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
        wall = clock.timebase()  # anchored before this step's stamps (at the last wait)
        if self.param_gather is not None:
            self.param_gather.waited = []  # waits outside a step are not the step's
        if self.tp_waits is not None:
            self.tp_waits.clear()
        t = [clock.stamp()]
        local_loss, pipe = self._forward_backward(batches, scale, marks)
        t.append(clock.stamp())
        self.reducer.finish()
        t.append(clock.stamp())
        waits = {"time_dp_exposed_s": [getattr(self.reducer, "wait_stamps", None)],
                 "time_zero_gather_exposed_s": list(self.param_gather.waited) if getattr(
                     self.param_gather, "overlap", False) else None}  # (synchronous: no waits)
        sync_sequence_parallel_grads(self.params, self.ps)
        sum_embedding_grads(self.ps, self.shared)
        synced = getattr(self.optimizer, "grads_synced", None)
        if synced is not None:  # the offloaded optimizer copies the buckets those sums changed
            synced()
        t.append(clock.stamp())
        waits["time_tp_exposed_s"] = None if self.tp_waits is None else list(self.tp_waits)
        stats, check = self.statistics(local_loss, pipe)
        t.append(clock.stamp())
        phase = stage_times = spans = None
        if pipe is not None:  # complete since the wait: read without waiting
            phase, stage_times = phase_times(pipe.events), stage_compute_times(pipe.events, self.ps)
            spans = pipe.transfer_spans
        return Computed(stats.loss, check, scale, pipe, stats, self.agreement.split(stats.counts),
                        snapshot, t, marks, wall, phase, stage_times or (), spans, waits,
                        moe=self.moe_figures)

    def apply(self, pre: Computed, lr: float) -> StepOutput:
        """The update of a computed step (none when it is skipped), then its figures: the
        previous step's late ones are completed (this step's wait followed them), this step's
        update span and bubble wait for the next step's wait (``out.complete`` False until then)."""
        clock, t, marks = self.clock, list(pre.stamps), list(pre.marks)
        if not pre.check.skipped:
            self.optimizer.step(lr)
            if pre.moe is not None:  # aux-loss-free balancing: the global load moves the bias
                update_expert_bias(self.chunks, self.moe, pre.moe["loads"])
        else:
            self.optimizer.skipped_step()
        t.append(clock.stamp())
        self.agreed = pre.agreed
        comm = self.ps.comm.since(pre.snapshot)
        marks += [(name, cat, t[i + 1], t[i + 2], -1, 0) for i, (name, cat) in enumerate(_PHASES)]
        times = [clock.elapsed_s(t[i], t[i + 1]) for i in range(len(t) - 3)] + [None, None]
        out = StepOutput(pre.loss, pre.check.grad_norm, pre.check.skipped, pre.scale, comm, pre.pipe,
                         dict(zip(TIME_KEYS, times)), marks, rank=self.ps.rank, wall=pre.wall)
        out.times.update(exposed_times(clock, pre.waits))
        out.extra["moe"] = pre.moe
        if self.late is not None:
            self.late.complete(clock, pre.stats)
        transfers = (self.schedule_lists, pre.spans) if self.schedule_lists and pre.spans is not None \
            else None
        self.late = LateFigures(out, (t[-3], t[-2], t[-1]), pre.phase, pre.stage_times, transfers)
        return out

    def flush(self) -> None:
        """Read the last step's late figures (every rank, after its last step: with a pipeline
        this is one more statistics all-reduce). Its wait is outside any step."""
        late, self.late = self.late, None
        if late is None:
            return
        stats = None
        if late.phase is not None:
            with self.ps.comm.uncounted():
                per_rank, per_stage = late.carried(self.ps)
                zero = torch.zeros((), dtype=torch.float32, device=self.ps.device)
                stats = reduce_step_stats(self.ps, zero, torch.zeros(2, device=self.ps.device),
                                          per_rank, per_stage, clock=self.clock)
        else:
            self.clock.synchronize("flush")
        late.complete(self.clock, stats)

    @torch.no_grad()
    def forward_only(self, batches) -> float:
        """Mean loss of these micro-batches over the grid, without gradients (validation): one
        host read, of the all-reduced sum; with pp > 1 the forward-only schedule is pipelined like
        training's forwards (schedules.forward_only_schedule), keeps no boundary tensor past its
        use (executor.run_schedule's ``forward_only``), and its transfers are waited for as in
        training (the step's waiter: on the stream under NCCL/HCCL), with no device-wide
        synchronize."""
        m = len(batches)
        device, dp = batches[0].tokens.device, self.ps.dp_cp_group.size
        if self.ps.pp_size == 1:
            model = self.chunks[0]
            losses = [micro_batch_loss(model(mb.tokens, mb.labels, mb.inputs), mb, m, dp)
                      for mb in batches]
            return mean_loss_over_grid(torch.stack(losses).float().sum(), self.ps, device,
                                       clock=self.clock)
        actions = forward_only_schedule(self.ps.pp_size, m, len(self.chunks), self.placement)
        result = run_schedule(self.ps, actions, list(self.chunks), self._forward_step(batches, 1.0),
                              m, self.act_shape, self.act_dtype, self.timeout_s, waiter=self.waiter,
                              clock=self.clock, deallocate_outputs=False, forward_only=True,
                              scatter_gather=self.scatter_gather)
        local = result.loss_sum
        if local is None:  # not the last stage: its slot is not counted
            local = torch.zeros((), dtype=torch.float32, device=device)
        return mean_loss_over_grid(local, self.ps, device, holds_loss=self.holds_loss,
                                   clock=self.clock)
