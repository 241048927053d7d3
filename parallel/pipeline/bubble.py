"""Pipeline bubble: the closed forms, a discrete-event replay of a schedule, and the measurement.

The bubble is the fraction of a step's wall time that a stage spends idle. With ``p`` stages, ``m``
micro-batches and equal work per stage, GPipe and 1F1B both idle ``(p-1)`` forward+backward slots
per rank, so idle/total = ``(p-1)/(m+p-1)``. The interleaved schedule with ``v`` chunks per rank
shrinks each slot to ``1/v``: the Megatron-LM paper (Narayanan et al. 2021, sec. 2.2.2) writes the
bubble relative to the ideal time as ``(1/v)(p-1)/m``, which as a fraction of total time is
``(p-1)/(v*m + p-1)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from parallel.pipeline.schedules import B, F, SCHEDULES, Action, replay


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the step for equal-cost stages (0.0 without pipelining)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; "
                         f"use one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"theoretical_bubble: p, m and v must be >= 1, got p={p} m={m} v={v}")
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
             bwd_time: float | Sequence[float], p2p_time: float = 0.0) -> SimResult:
    """Replay a schedule with the given per-stage costs; transfers cost ``p2p_time`` each.

    Dependencies are the executor's: a forward needs its input from the previous virtual stage, a
    backward its output gradient from the next one and its own forward, and a batch of transfers
    waits for every peer to post its side (``schedules.replay``).
    """
    pp = len(lists)
    vp = 1 + max(a.chunk for actions in lists for a in actions)
    fwd = _per_stage(fwd_time, pp, vp, "fwd_time")
    bwd = _per_stage(bwd_time, pp, vp, "bwd_time")

    def cost(rank: int, action: Action) -> float:
        return fwd(rank, action.chunk) if action.kind == F else bwd(rank, action.chunk)

    times = replay(lists, cost, p2p_time)
    makespan = max((t[-1][1] for t in times if t), default=0.0)
    timings, idle = [], []
    for actions, spans in zip(lists, times):
        timings.append([(a, start, end) for a, (start, end) in zip(actions, spans)])
        busy = sum(end - start for a, (start, end) in zip(actions, spans) if a.kind in (F, B))
        idle.append(1.0 - busy / makespan if makespan > 0 else 0.0)
    return SimResult(makespan, sum(idle) / pp if pp else 0.0, idle, timings)


@dataclass
class BubbleMeasurement:
    per_rank: list[float]        # 1 - (forward + backward time) / step wall time
    mean: float
    wait_per_rank: list[float]   # time blocked in transfers / step wall time (part of per_rank)


def measured_bubble(events, step_wall: float) -> BubbleMeasurement:
    """Idle fraction per rank from executor events (``PipelineEvent``-like objects or dicts).

    ``events`` is one list of events per rank (as gathered by ``timeline.gather_events``) or a flat
    list whose events carry ``rank``. A rank is idle whenever it is not computing a forward or
    backward: blocked in a receive or send (also reported alone as ``wait_per_rank``) or finished
    early while other stages drain the pipeline. ``step_wall`` is the step's wall time, the same for
    every rank (for example the max over ranks of the executor's ``wall_s``).
    """
    if step_wall <= 0:
        raise ValueError(f"measured_bubble: step_wall must be > 0 seconds, got {step_wall}")
    by_rank = _group_by_rank(events)
    busy_f, wait_f = [], []
    for rank_events in by_rank:
        busy = wait = 0.0
        for e in rank_events:
            kind, dur = _get(e, "cat"), _get(e, "end") - _get(e, "start")
            if kind in ("forward", "backward"):
                busy += dur
            elif kind == "comm":
                wait += dur
        busy_f.append(max(0.0, 1.0 - busy / step_wall))
        wait_f.append(min(1.0, wait / step_wall))
    mean = sum(busy_f) / len(busy_f) if busy_f else 0.0
    return BubbleMeasurement(busy_f, mean, wait_f)


def _get(event, name: str):
    return event[name] if isinstance(event, dict) else getattr(event, name)


def _group_by_rank(events) -> list[list]:
    events = list(events)
    if events and isinstance(events[0], (list, tuple)):
        return [list(rank_events) for rank_events in events]
    ranks = sorted({_get(e, "rank") for e in events})
    return [[e for e in events if _get(e, "rank") == r] for r in ranks]
