"""Checking a schedule and replaying it as the executor runs it.

``validate_schedule`` proves, before anything runs, that a schedule computes the right gradients
and cannot hang: every (micro-batch, chunk) runs F, then B, then (when the schedule splits the
backward) W exactly once on its rank; every F and B is wrapped in exactly the transfers its virtual
stage needs, and a boundary that stays on one rank (the V placement's turn) is crossed in order; every
send is matched by the neighbour's receive of the same message in the same order; and the program
cannot deadlock when each batch of transfers blocks until every peer has posted its side. It returns
the in-flight peaks: per rank, the most (micro-batch, chunk) activations held at once, from a
forward to the end of its backward (its W when there is one). A forward-only (validation) program
is checked the same way with ``forward_only=True``: forwards and activation transfers only.
"""
from __future__ import annotations

from typing import Callable

from parallel.pipeline.actions import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Kind,
                                       batches, has_weight_actions, message, neighbour,
                                       placement_of)
from parallel.pipeline.partition import virtual_stage


class ScheduleError(ValueError):
    """A schedule that would compute wrong gradients, mismatch transfers or deadlock."""


def _shape(lists) -> tuple[int, int, str]:
    pp = len(lists)
    vp = 1 + max((a.chunk for actions in lists for a in actions), default=0)
    return pp, vp, placement_of(lists)


def _peer(action: Action, rank: int, pp: int, vp: int, placement: str) -> tuple[int, tuple]:
    """(peer pp rank, message id) of a transfer; the id names the stage boundary it crosses."""
    try:
        return message(action, rank, pp, vp, placement)
    except ValueError as exc:
        raise ScheduleError(str(exc)) from None


def match_messages(lists, vp: int | None = None) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair the k-th send from rank a to rank b with the k-th receive on b from a.

    Returns ``{(rank, index): (peer_rank, peer_index)}``; raises when the message sent is not the
    one the peer expects at that position (the backends match transfers between two ranks in posting
    order, so such a schedule would silently swap tensors).
    """
    pp, inferred_vp, placement = _shape(lists)
    vp = inferred_vp if vp is None else vp
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank, actions in enumerate(lists):
        for i, a in enumerate(actions):
            if a.is_comm:
                peer, msg = _peer(a, rank, pp, vp, placement)
                if a.kind in (SEND_F, SEND_B):
                    sends.setdefault((rank, peer), []).append((msg, i))
                else:
                    recvs.setdefault((peer, rank), []).append((msg, i))
    partner = {}
    for channel in set(sends) | set(recvs):
        src, dst = channel
        out, inc = sends.get(channel, []), recvs.get(channel, [])
        if len(out) != len(inc):
            raise ScheduleError(f"rank {src} sends {len(out)} messages to rank {dst}, which "
                                f"receives {len(inc)}")
        for k, ((msg_s, i), (msg_r, j)) in enumerate(zip(out, inc)):
            if msg_s != msg_r:
                raise ScheduleError(f"message {k} from rank {src} to rank {dst} is {msg_s} but "
                                    f"rank {dst} expects {msg_r} there")
            partner[(src, i)] = (dst, j)
            partner[(dst, j)] = (src, i)
    return partner


def replay_blocking(lists, compute_time: Callable[[int, Action], float],
                    p2p_time: float = 0.0) -> list[list[tuple[float, float]]]:
    """The strictest reading of a program, used to prove it cannot hang on any backend: a batch of
    consecutive transfers (actions.py ``batches``) is posted when the rank reaches it and the rank
    waits for the whole batch at once, until every transfer in it has both sides posted (a receive
    needs the peer's send, and a send its receive: NCCL and HCCL run a batch as one group that
    completes only then).
    Compute actions run back to back. Returns (start, end) of every action; raises
    ``ScheduleError`` on deadlock, naming what each blocked rank waits for. A program that runs
    here also runs when waits are deferred (``replay``): every transfer completes no later."""
    pp = len(lists)
    partner = match_messages(lists)
    _, vp, placement = _shape(lists)
    ends = [dict(batches(actions, r, pp, vp, placement)) for r, actions in enumerate(lists)]
    pos, clock = [0] * pp, [0.0] * pp
    posted: dict[tuple[int, int], float] = {}
    times: list[list] = [[None] * len(actions) for actions in lists]
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        moved, blocked = False, {}
        for r, actions in enumerate(lists):
            while pos[r] < len(actions):
                action = actions[pos[r]]
                if not action.is_comm:
                    end = clock[r] + compute_time(r, action)
                    times[r][pos[r]] = (clock[r], end)
                    clock[r], pos[r], moved = end, pos[r] + 1, True
                    continue
                stop = ends[r][pos[r]]          # one batch (actions.py ``batches``)
                for i in range(pos[r], stop):
                    posted.setdefault((r, i), clock[r])
                waiting = [i for i in range(pos[r], stop) if partner[(r, i)] not in posted]
                if waiting:
                    blocked[r] = (actions[waiting[0]], partner[(r, waiting[0])])
                    break
                end = max(max(posted[(r, i)], posted[partner[(r, i)]]) + p2p_time
                          for i in range(pos[r], stop))
                for i in range(pos[r], stop):
                    times[r][i] = (clock[r], end)
                clock[r], pos[r], moved = end, stop, True
        if not moved:
            _deadlock(lists, blocked)
    return times


def _deadlock(lists, blocked: dict) -> None:
    detail = "; ".join(f"rank {r} waits at {a!r} for rank {pr} to post {lists[pr][pi]!r}"
                       for r, (a, (pr, pi)) in sorted(blocked.items()))
    raise ScheduleError(f"the schedule deadlocks: {detail}")


def consumers(actions: list[Action]) -> dict[int, int]:
    """For each receive in a program, the index of the compute action that consumes it (the F of
    a received activation, the B of a received gradient)."""
    where = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(actions) if not a.is_comm}
    return {i: where[(F if a.kind == RECV_F else B, a.microbatch, a.chunk)]
            for i, a in enumerate(actions) if a.kind in (RECV_F, RECV_B)}


def _transfer_cost(value, label: str) -> Callable[[int, Action], float]:
    if callable(value):
        return value
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"replay: {label} must be seconds >= 0 or a function (rank, action) -> "
                         f"seconds, got {value!r}")
    return lambda rank, action: float(value)


def replay(lists, compute_time: Callable[[int, Action], float],
           p2p_time: float | Callable[[int, Action], float] = 0.0,
           post_time: float | Callable[[int, Action], float] = 0.0
           ) -> list[list[tuple[float, float]]]:
    """Replay the program as the executor runs it: (start, end) of every action on every rank.

    Compute actions run back to back, each after the receives it consumes. A transfer is posted
    when the rank reaches it, without waiting for it: posting occupies the rank for
    ``post_time(rank, action)``, and its side is ready when that ends. A message is ready once
    both sides are; its receive is waited for just before the compute action that consumes it,
    and costs ``p2p_time(rank, action)`` (asked of the receive; a float: every message the same)
    from the later of the message being ready and the compute needing it: the wait after both
    (parallel/pipeline/transfers.py measures exactly that part of a wait as exposed). A send
    completes with its receive; the rank waits for its sends at the end of the program. A
    transfer's span is (post start, completed). Raises ``ScheduleError`` if no rank can move.
    """
    pp = len(lists)
    partner = match_messages(lists)
    latency, post = _transfer_cost(p2p_time, "p2p_time"), _transfer_cost(post_time, "post_time")
    needs: list[dict[int, list[int]]] = []
    for actions in lists:
        table: dict[int, list[int]] = {}
        for recv, consumer in consumers(actions).items():
            table.setdefault(consumer, []).append(recv)
        needs.append(table)
    pos, clock = [0] * pp, [0.0] * pp
    started: dict[tuple[int, int], float] = {}
    posted: dict[tuple[int, int], float] = {}
    arrived: dict[tuple[int, int], float] = {}      # receives, once consumed: their completion
    times: list[list] = [[None] * len(actions) for actions in lists]

    def ready(r: int, i: int) -> float | None:
        other = posted.get(partner[(r, i)])
        return None if other is None else max(posted[(r, i)], other)

    while any(pos[r] <= len(lists[r]) for r in range(pp)):
        moved, blocked = False, {}
        for r, actions in enumerate(lists):
            while pos[r] <= len(actions):
                i = pos[r]
                if i == len(actions):                       # the end: wait for every send
                    sends = [j for j, a in enumerate(actions) if a.kind in (SEND_F, SEND_B)]
                    done = [arrived.get(partner[(r, j)]) for j in sends]
                    if any(t is None for t in done):
                        j = sends[done.index(None)]
                        blocked[r] = (actions[j], partner[(r, j)])
                        break
                    clock[r] = max([clock[r], *done])
                    pos[r], moved = i + 1, True
                    continue
                action = actions[i]
                if action.is_comm:
                    started[(r, i)] = clock[r]
                    clock[r] += float(post(r, action))
                    posted[(r, i)] = clock[r]
                    pos[r], moved = i + 1, True
                    continue
                recvs = needs[r].get(i, ())
                done = [ready(r, j) for j in recvs]
                if any(t is None for t in done):
                    j = recvs[done.index(None)]
                    blocked[r] = (actions[j], partner[(r, j)])
                    break
                start = clock[r]
                for j, t in zip(recvs, done):
                    arrived[(r, j)] = max(t, clock[r]) + float(latency(r, actions[j]))
                    start = max(start, arrived[(r, j)])
                clock[r] = start + compute_time(r, action)
                times[r][i] = (start, clock[r])
                pos[r], moved = i + 1, True
        if not moved:
            _deadlock(lists, blocked)
    for r, actions in enumerate(lists):
        for i, a in enumerate(actions):
            if a.is_comm:
                end = arrived[(r, i)] if a.kind in (RECV_F, RECV_B) else arrived[partner[(r, i)]]
                times[r][i] = (started[(r, i)], end)
    return times


def in_flight_peaks(lists) -> list[int]:
    """Per rank, the most (micro-batch, chunk) activations held at once: from a forward to the end
    of its backward, which is its W when the program has W actions (the weight gradients need the
    inputs the forward saved), else its B."""
    peaks = []
    for actions in lists:
        ends = W if has_weight_actions(actions) else B
        live = peak = 0
        for a in actions:
            live += (a.kind == F) - (a.kind == ends)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def forward_only_peaks(lists) -> list[int]:
    """Per rank, the most output activations a forward-only program holds at once: each from its F
    until its SEND_F is posted or the next stage's F on the same rank (the V's turn) has taken it;
    the last stage keeps its loss only, so its output counts during its F alone. The executor counts
    the same (``PipelineResult.peak_in_flight`` of a forward-only run)."""
    pp, vp, placement = _shape(lists)
    peaks = []
    for rank, actions in enumerate(lists):
        live = peak = 0
        for a in actions:
            if a.kind == F:
                before = neighbour(rank, a.chunk, pp, vp, placement, -1)
                live += 1 - (before is not None and before[0] == rank)   # a turn takes its input
                peak = max(peak, live)
                live -= neighbour(rank, a.chunk, pp, vp, placement, +1) is None
            elif a.kind == SEND_F:
                live -= 1
        peaks.append(peak)
    return peaks


def _positions(actions: list[Action], rank: int) -> dict[tuple, int]:
    where: dict[tuple, int] = {}
    for i, a in enumerate(actions):
        key = (a.kind, a.microbatch, a.chunk)
        if key in where:
            raise ScheduleError(f"rank {rank}: {a!r} appears twice (positions {where[key]} and {i})")
        where[key] = i
    return where


def _check_program(lists, pp: int, vp: int, m: int, placement: str,
                   forward_only: bool = False) -> None:
    """Every (micro, chunk) runs F, B and (all or none) W once, in that order, each F and B wrapped
    by exactly its transfers; on a boundary inside a rank the stages run in pipeline order. A
    forward-only program has F and its activation transfers only."""
    split = has_weight_actions(lists)
    wraps = ((RECV_F, F, True, -1), (SEND_F, F, False, +1))
    if not forward_only:
        wraps += ((RECV_B, B, True, +1), (SEND_B, B, False, -1))
    for rank, actions in enumerate(lists):
        where = _positions(actions, rank)
        extra = [a for a in actions if a.kind in (B, W, RECV_B, SEND_B)] if forward_only else []
        if extra:
            raise ScheduleError(f"rank {rank}: {extra[0]!r} in a forward-only schedule (forwards "
                                f"and activation transfers only)")
        for micro in range(m):
            for chunk in range(vp):
                pos = {k: where.get((k, micro, chunk)) for k in Kind}
                what = f"micro-batch {micro} chunk {chunk}"
                if pos[F] is None or (pos[B] is None and not forward_only):
                    raise ScheduleError(f"rank {rank}: {what} lacks its forward"
                                        + ("" if forward_only else " or backward"))
                if pos[B] is not None and pos[F] > pos[B]:
                    raise ScheduleError(f"rank {rank}: backward of {what} comes before its forward")
                if split and pos[W] is None:
                    raise ScheduleError(f"rank {rank}: {what} has no W (the weight gradients of "
                                        f"a split backward must run exactly once per chunk)")
                if pos[W] is not None and pos[W] < pos[B]:
                    raise ScheduleError(f"rank {rank}: W({micro},{chunk}) runs before its B")
                for comm, compute, comes_first, step in wraps:
                    other = neighbour(rank, chunk, pp, vp, placement, step)
                    if other is None or other[0] == rank:
                        if pos[comm] is not None:
                            stage = virtual_stage(rank, chunk, pp, placement)
                            why = "no neighbour" if other is None else "its neighbour on this rank"
                            raise ScheduleError(f"rank {rank}: virtual stage {stage} has {why} "
                                                f"for {comm.name}({micro},{chunk})")
                        if other is not None and comes_first:
                            _check_local(where, rank, micro, chunk, other[1], compute)
                        continue
                    if pos[comm] is None or (pos[comm] < pos[compute]) != comes_first:
                        where_ = "before" if comes_first else "after"
                        raise ScheduleError(f"rank {rank}: {comm.name}({micro},{chunk}) must come "
                                            f"{where_} {compute.name}({micro},{chunk})")


def _check_local(where, rank: int, micro: int, chunk: int, other: int, compute: Kind) -> None:
    """A boundary inside a rank: F of the later stage after F of the earlier one, B of the earlier
    stage after B of the later one."""
    before = where.get((compute, micro, other))
    if before is None or before > where[(compute, micro, chunk)]:
        raise ScheduleError(f"rank {rank}: {compute.name}({micro},{chunk}) needs "
                            f"{compute.name}({micro},{other}) of the neighbouring stage on this "
                            f"rank to run first")


def validate_schedule(lists, forward_only: bool = False) -> list[int]:
    """Check a schedule and return the peak number of in-flight activations per rank.

    Checks: on every rank and chunk each micro-batch's forward precedes its backward, and its W
    (when the schedule splits backwards) comes after the B, exactly once; each F and B is wrapped by
    exactly the transfers its virtual stage needs; every send is matched by the neighbour's receive
    of the same message in the same order; and the program cannot deadlock when each batch of
    transfers blocks until every peer has posted its side. In-flight counts the (micro-batch,
    chunk) activations held from F to the end of their backward: 1F1B keeps at most ``pp - rank``,
    GPipe all ``m``, ZB-H1 ``min(pp, m)`` on every rank.

    ``forward_only``: a validation program (``schedules.forward_only_schedule``): every F once with
    its activation transfers, no backward, W or gradient transfer; the peaks are then
    ``forward_only_peaks``.
    """
    pp = len(lists)
    if pp == 0 or not all(lists):
        raise ScheduleError("a schedule needs one non-empty action list per pipeline rank")
    actions = [a for rank_actions in lists for a in rank_actions]
    if any(a.microbatch < 0 or a.chunk < 0 for a in actions):
        raise ScheduleError("micro-batch and chunk indices must be >= 0")
    m = 1 + max(a.microbatch for a in actions)
    _, vp, placement = _shape(lists)
    _check_program(lists, pp, vp, m, placement, forward_only)
    replay_blocking(lists, lambda rank, action: 1.0)
    return forward_only_peaks(lists) if forward_only else in_flight_peaks(lists)
