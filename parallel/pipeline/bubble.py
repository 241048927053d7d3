"""Pipeline bubble: the closed forms, a discrete-event replay of a schedule, and the measurement.

Measured (``measured_bubble``, the ``bubble_measured`` metric): per rank, the device time it
spends in pipeline transfers plus its idle outside its own phase (the span less its first to last
action), over the span of the step's pipeline phase, the longest of the ranks' phases; averaged
over ranks. Only durations, each on its rank's own clock, enter: ranks on different hosts have
clocks that disagree, so no instant of one rank is subtracted from another's.
The simulation's idle fraction means the same on a replayed schedule, so with deterministic stage
costs the two agree (tests/parallel/pipeline/test_bubble_timing.py).

The bubble is the fraction of a step's wall time that a stage spends idle. With ``p`` stages, ``m``
micro-batches and equal work per stage, GPipe and 1F1B both idle ``(p-1)`` forward+backward slots
per rank, so idle/total = ``(p-1)/(m+p-1)``. The interleaved schedule with ``v`` chunks per rank
shrinks each slot to ``1/v``: the Megatron-LM paper (Narayanan et al. 2021, sec. 2.2.2) writes the
bubble relative to the ideal time as ``(1/v)(p-1)/m``, which as a fraction of total time is
``(p-1)/(v*m + p-1)``.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split the
backward into B (input gradient) and W (weight gradients). With per-stage costs ``T_F, T_B, T_W``
a rank of 1F1B idles ``(p-1)(T_F + T_B + T_W)`` (B and W fused); the paper's ZB-H1 idles
``(p-1)(T_F + T_B - T_W)`` (its section 3.1, for ``m >= p``), a third of 1F1B's when the three are
equal. ``theoretical_bubble`` gives each schedule's exact fraction for equal costs, one unit for
each of F, B and W of one chunk (what ``simulate`` with equal costs reproduces):

    1f1b-w:  2(p-1) / (3m + 2(p-1))              (W right after B: rank p-1's W leaves the critical
                                                  path, so a rank idles (p-1)(T_F + T_B))
    zb-h1:   (p-1+e) / (3m + p-1+e),  e = max(0, p-m)    ((p-1)(T_F+T_B-T_W) for m >= p; with fewer
                                                  micro-batches than stages the held-back W run
                                                  out and the last rank idles e units more)
    zb-v:    1 - 6m / max(6m + p - 1, 4m + 4p - 2)   (two chunks of half a stage each: p-1 chunk
                                                  units per rank once m >= (3p-1)/2; below that
                                                  the step is the dependency chain of the last
                                                  micro-batches, 4(m + p) - 2 units)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from parallel.pipeline.schedules import B, F, SCHEDULES, W, Action, has_weight_actions, replay

COMPUTE_CATS = ("forward", "backward", "weight")   # executor event categories of compute actions


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the step for equal-cost stages (0.0 without pipelining); for the
    zero-bubble schedules F, B and W of a chunk cost the same (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; "
                         f"use one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"theoretical_bubble: p, m and v must be >= 1, got p={p} m={m} v={v}")
    if schedule == "1f1b-w":
        return 2 * (p - 1) / (3 * m + 2 * (p - 1))
    if schedule == "zb-h1":
        idle = p - 1 + max(0, p - m)
        return idle / (3 * m + idle)
    if schedule == "zb-v":
        return 1.0 - 6 * m / max(6 * m + p - 1, 4 * m + 4 * p - 2)
    if schedule != "interleaved":
        v = 1
    return (p - 1) / (v * m + p - 1)


@dataclass
class SimResult:
    makespan: float
    idle_fraction: float                      # over all ranks: 1 - busy / (p * makespan)
    idle_per_rank: list[float]
    timings: list[list[tuple[Action, float, float]]] = field(repr=False)  # per rank, in order

    @property
    def pp(self) -> int:
        return len(self.timings)


def _per_stage(value, pp: int, vp: int, label: str):
    """Cost lookup ``(rank, chunk) -> seconds`` from a scalar, per-rank or per-stage list."""
    if isinstance(value, (int, float)):
        return lambda rank, chunk: float(value)
    values = list(value)
    if len(values) == pp:
        return lambda rank, chunk: float(values[rank])
    if len(values) == pp * vp:
        return lambda rank, chunk: float(values[chunk * pp + rank])
    raise ValueError(f"simulate: {label} needs one value, {pp} (one per rank) or {pp * vp} "
                     f"(one per virtual stage), got {len(values)}")


def simulate(lists: list[list[Action]], fwd_time: float | Sequence[float],
             bwd_time: float | Sequence[float], p2p_time: float | Callable = 0.0,
             wgt_time: float | Sequence[float] | None = None,
             post_time: float | Callable = 0.0) -> SimResult:
    """Replay a schedule with the given per-stage costs; a message completes ``p2p_time`` after
    both sides posted it and posting a transfer occupies its rank for ``post_time`` (each a float
    or a function (rank, action) -> seconds, ``schedules.replay``; measured ones:
    ``transfers.StageTransfers.costs``). Time in transfers counts as idle, as in the measurement.

    Dependencies are the executor's (``schedules.replay``): a forward needs its input from the
    previous virtual stage, a backward its output gradient from the next one and its own
    forward, a W its B; a rank waits for a receive just before the action that consumes it.
    ``bwd_time`` is the cost of B: the whole backward in schedules without W actions, the input
    gradient alone in those with them, whose W cost ``wgt_time``. Each cost is one value, one per
    rank or one per virtual stage (index ``chunk * pp + rank``: the chunk's position in the
    program, also under the V placement).
    """
    pp = len(lists)
    vp = 1 + max(a.chunk for actions in lists for a in actions)
    if has_weight_actions(lists) and wgt_time is None:
        raise ValueError("simulate: the schedule has W actions (weight gradients); give their "
                         "cost as wgt_time")
    fwd = _per_stage(fwd_time, pp, vp, "fwd_time")
    bwd = _per_stage(bwd_time, pp, vp, "bwd_time")
    wgt = _per_stage(wgt_time if wgt_time is not None else 0.0, pp, vp, "wgt_time")
    table = {F: fwd, B: bwd, W: wgt}

    def cost(rank: int, action: Action) -> float:
        return table[action.kind](rank, action.chunk)

    times = replay(lists, cost, p2p_time, post_time)
    makespan = max((end for spans in times for _, end in spans), default=0.0)
    timings, idle = [], []
    for actions, spans in zip(lists, times):
        timings.append([(a, start, end) for a, (start, end) in zip(actions, spans)])
        busy = sum(end - start for a, (start, end) in zip(actions, spans) if not a.is_comm)
        idle.append(1.0 - busy / makespan if makespan > 0 else 0.0)
    return SimResult(makespan, sum(idle) / pp if pp else 0.0, idle, timings)


@dataclass
class PhaseTimes:
    """One rank's pipeline phase, from its executor events (device times, wall-clock seconds)."""
    first: float     # start of its first action (a compute or a transfer)
    last: float      # end of its last action
    wait: float      # seconds in pipeline transfers (waiting for receives, and for sends' peers)
    compute: float   # seconds in forwards, backwards and weight gradients


def phase_times(events) -> PhaseTimes:
    """``events``: one rank's TimelineEvents (or dicts) of one step, as the executor records them."""
    events = list(events)
    if not events:
        raise ValueError("phase_times: no pipeline events (did the step run the executor?)")
    wait = compute = 0.0
    for e in events:
        dur = _get(e, "end") - _get(e, "start")
        if _get(e, "cat") == "comm":
            wait += dur
        elif _get(e, "cat") in COMPUTE_CATS:
            compute += dur
    return PhaseTimes(min(_get(e, "start") for e in events), max(_get(e, "end") for e in events),
                      wait, compute)


def rank_bubble(phase: PhaseTimes, span: float) -> float:
    """A rank's bubble over the pipeline phase of length ``span`` (the longest phase of the
    pipeline's ranks, each measured on its own clock): its time in transfers plus the idle outside
    its own phase (``span`` minus its phase), over the span. Only durations enter: no rank's
    instants are compared with another's, whose clock may be another host's. Host time between
    actions (Python, kernel launches) is not counted."""
    if span <= 0:
        raise ValueError(f"rank_bubble: the pipeline phase must have a positive span, got {span}")
    idle = phase.wait + span - (phase.last - phase.first)
    return idle / span


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


def pipeline_bubble(ps, events) -> float:
    """This rank's ``rank_bubble`` over its pipeline's phase, on every rank of the pipeline group:
    the longest phase of the stages through one all-reduce (max of int64 microseconds: HCCL
    reduces no float64)."""
    import torch
    import torch.distributed as dist
    phase = phase_times(events)
    span = torch.tensor([_us(phase.last) - _us(phase.first)], dtype=torch.int64, device=ps.device)
    ps.pp_group.all_reduce(span, op=dist.ReduceOp.MAX)
    return rank_bubble(phase, span.item() / 1e6)


def pipeline_bubble_tensor(ps, phase: PhaseTimes):
    """``pipeline_bubble`` without a host read: this rank's bubble as a 0-d fp32 device tensor,
    from the same MAX all-reduce of the phases' durations (int64 microseconds). The trainer adds
    it to the next step's statistics all-reduce, so the bubble costs no wait of its own."""
    return reduce_phase(ps, phase)[0]


def reduce_phase(ps, phase: PhaseTimes, extra: Sequence[int] = ()):
    """``pipeline_bubble_tensor``'s MAX all-reduce over the pipeline group, of the phase's
    duration and of ``extra`` int64 values (transfers.py: every rank's post times): (this rank's
    bubble as a 0-d fp32 device tensor, the reduced ``extra`` as an int64 device tensor)."""
    import torch
    import torch.distributed as dist
    own = _us(phase.last) - _us(phase.first)
    values = torch.tensor([own, *extra], dtype=torch.int64)
    if torch.device(ps.device).type not in ("cpu", "meta"):  # a pageable copy would wait
        values = values.pin_memory().to(ps.device, non_blocking=True)
    values = values.to(ps.device)
    ps.pp_group.all_reduce(values, op=dist.ReduceOp.MAX)
    span = values[0]   # the pipeline's longest phase (us)
    # differences of int64 microseconds are exact; only then fp32
    idle = (span - own).to(torch.float32) + phase.wait * 1e6
    return idle / span.clamp(min=1).to(torch.float32), values[1:]


@dataclass
class BubbleMeasurement:
    per_rank: list[float]        # rank_bubble of each rank over the pipeline's span
    mean: float
    wait_per_rank: list[float]   # time in transfers / span (part of per_rank)
    span: float                  # seconds: the longest of the ranks' phases (each on its own clock)


def measured_bubble(events) -> BubbleMeasurement:
    """The measured bubble of one step of one pipeline (``bubble_measured`` of docs/design.md).

    ``events`` is one list of executor events per pipeline rank (as gathered by
    ``timeline.gather_events``), or a flat list whose events carry ``rank``. Per rank: the time in
    pipeline transfers plus the idle outside its own phase (its first to its last action), over the
    span of the pipeline phase (the longest of the ranks' phases: each rank's duration on its own
    clock, so hosts' clocks are never compared; under GPipe and 1F1B the first stage's phase runs
    from the pipeline's first forward to its last backward, the whole phase; where another
    stage's last W comes later the span is short by that tail);
    averaged over ranks. The optimizer, the DP reduction's tail, clipping and the tied /
    sequence-parallel all-reduces come after the phase and are not in it.
    """
    phases = [phase_times(rank_events) for rank_events in _group_by_rank(events)]
    span = max(_us(p.last) - _us(p.first) for p in phases) / 1e6
    per_rank = [rank_bubble(p, span) for p in phases]
    return BubbleMeasurement(per_rank, sum(per_rank) / len(per_rank),
                             [p.wait / span for p in phases], span)


def _get(event, name: str):
    return event[name] if isinstance(event, dict) else getattr(event, name)


def _group_by_rank(events) -> list[list]:
    events = list(events)
    if events and isinstance(events[0], (list, tuple)):
        return [list(rank_events) for rank_events in events]
    ranks = sorted({_get(e, "rank") for e in events})
    return [[e for e in events if _get(e, "rank") == r] for r in ranks]
