"""Pipeline schedules as data: one ordered list of actions per pipeline rank.

A schedule is built once per step shape ``(schedule, pp, num_microbatches, vp)`` and run by
``executor.run_schedule``; the same lists feed ``validate_schedule`` (ordering, matching, deadlock
freedom), ``bubble.simulate`` (a timing replay) and the Gantt charts, so what is tested and drawn is
exactly what runs.

Consecutive transfer actions form one batch that the executor posts with a single
``batch_isend_irecv`` and waits for as a whole. GPipe and 1F1B wrap each compute action in its
transfers (``RECV_F F SEND_F``, ``RECV_B B SEND_B``), so 1F1B's steady state yields Megatron's
``send_forward_recv_backward`` and ``send_backward_recv_forward`` batches. The interleaved schedule
follows Megatron's one batch per step (send what was produced, receive the next forward's input
and the next backward's gradient). Inside a batch actions are ordered activations first, gradients
second, sends before receives, on every rank: with pp=2 both neighbours are the same peer, and the
backends pair the messages between two ranks in posting order.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Kind(str, Enum):
    RECV_F = "recv_f"   # receive this chunk's input activation from the previous virtual stage
    F = "f"             # forward of one micro-batch through one chunk
    SEND_F = "send_f"   # send the output activation to the next virtual stage
    RECV_B = "recv_b"   # receive the gradient of the output from the next virtual stage
    B = "b"             # backward of one micro-batch through one chunk
    SEND_B = "send_b"   # send the gradient of the input to the previous virtual stage


RECV_F, F, SEND_F, RECV_B, B, SEND_B = (Kind.RECV_F, Kind.F, Kind.SEND_F, Kind.RECV_B, Kind.B,
                                        Kind.SEND_B)
COMM_KINDS = frozenset({RECV_F, SEND_F, RECV_B, SEND_B})
_BATCH_ORDER = {SEND_F: 0, RECV_F: 1, SEND_B: 2, RECV_B: 3}


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int = 0

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __repr__(self) -> str:
        return f"{self.kind.name}({self.microbatch},{self.chunk})"


class _RankBuilder:
    """One rank's actions (one chunk per rank), each compute step wrapped by its transfers."""

    def __init__(self, pp: int, rank: int):
        self.first, self.last = rank == 0, rank == pp - 1
        self.actions: list[Action] = []

    def forward(self, micro: int) -> None:
        self.actions += ([] if self.first else [Action(RECV_F, micro)]) + [Action(F, micro)] \
            + ([] if self.last else [Action(SEND_F, micro)])

    def backward(self, micro: int) -> None:
        self.actions += ([] if self.last else [Action(RECV_B, micro)]) + [Action(B, micro)] \
            + ([] if self.first else [Action(SEND_B, micro)])

    def done(self) -> list[Action]:
        """The actions with each run of transfers sorted into the canonical batch order."""
        out, run = [], []
        for action in self.actions + [None]:
            if action is not None and action.is_comm:
                run.append(action)
                continue
            out.extend(sorted(run, key=lambda a: _BATCH_ORDER[a.kind]))
            run = []
            if action is not None:
                out.append(action)
        return out


# ---- the schedules ----------------------------------------------------------------------------

def _gpipe(pp: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards: every micro-batch's activations are held at once."""
    rb = _RankBuilder(pp, rank)
    for micro in range(m):              # forward phase (warmup: the whole batch)
        rb.forward(micro)
    for micro in range(m):              # backward phase (cooldown)
        rb.backward(micro)
    return rb.done()


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """PipeDream-flush / Megatron 1F1B: at most ``pp - rank`` micro-batches in flight on a rank."""
    rb = _RankBuilder(pp, rank)
    warmup = min(pp - rank - 1, m)
    steady = m - warmup
    for micro in range(warmup):                     # warmup: fill the pipeline
        rb.forward(micro)
    for i in range(steady):                         # steady state: one forward, one backward
        rb.forward(warmup + i)
        rb.backward(i)
    for micro in range(steady, m):                  # cooldown: drain the remaining backwards
        rb.backward(micro)
    return rb.done()


def _interleaved(pp: int, m: int, vp: int, rank: int) -> list[Action]:
    """Megatron interleaved 1F1B: each rank holds ``vp`` chunks; micro-batches go in groups of pp.

    The k-th forward on a rank runs chunk ``(k % (pp*vp)) // pp`` on micro-batch
    ``(k // (pp*vp)) * pp + k % pp``; backwards visit the chunks in reverse order. Transfers follow
    Megatron: after each forward (warmup), forward+backward pair (steady) or backward (cooldown) one
    batch sends what was produced and receives the inputs of the next forward and next backward.
    """
    last_stage = pp * vp - 1
    total = m * vp
    group = pp * vp
    warmup = min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
    steady = total - warmup

    def fwd(k: int) -> tuple[int, int]:           # (micro, chunk) of the k-th forward
        return (k // group) * pp + k % pp, (k % group) // pp

    def bwd(k: int) -> tuple[int, int]:           # (micro, chunk) of the k-th backward
        micro, chunk = fwd(k)
        return micro, vp - 1 - chunk

    def stage(chunk: int) -> int:
        return chunk * pp + rank

    out: list[Action] = []

    def batch(send_f: int | None = None, send_b: int | None = None,
              recv_f: int | None = None, recv_b: int | None = None) -> None:
        """Transfers after a compute step; arguments are forward/backward counters (k)."""
        if send_f is not None and stage(fwd(send_f)[1]) < last_stage:
            out.append(Action(SEND_F, *fwd(send_f)))
        if recv_f is not None and recv_f < total and stage(fwd(recv_f)[1]) > 0:
            out.append(Action(RECV_F, *fwd(recv_f)))
        if send_b is not None and stage(bwd(send_b)[1]) > 0:
            out.append(Action(SEND_B, *bwd(send_b)))
        if recv_b is not None and recv_b < total and stage(bwd(recv_b)[1]) < last_stage:
            out.append(Action(RECV_B, *bwd(recv_b)))

    batch(recv_f=0)
    for k in range(warmup):                                         # warmup: forwards only
        out.append(Action(F, *fwd(k)))
        batch(send_f=k, recv_f=k + 1, recv_b=0 if k == warmup - 1 and steady else None)
    if steady == 0:
        batch(recv_b=0)                                             # all forwards were warmup
    for i in range(steady):                                         # steady: 1F1B
        out.append(Action(F, *fwd(warmup + i)))
        out.append(Action(B, *bwd(i)))
        batch(send_f=warmup + i, send_b=i, recv_f=warmup + i + 1, recv_b=i + 1)
    for k in range(steady, total):                                  # cooldown: backwards only
        out.append(Action(B, *bwd(k)))
        batch(send_b=k, recv_b=k + 1)
    return out


def forward_only_schedule(pp_size: int, num_microbatches: int, vp: int = 1) -> list[list[Action]]:
    """Forwards and activation transfers only (validation): each micro-batch passes through every
    virtual stage in turn, so the lists cannot deadlock and hold one activation at a time."""
    lists: list[list[Action]] = [[] for _ in range(pp_size)]
    for rank, actions in enumerate(lists):
        for mb in range(num_microbatches):
            for chunk in range(vp):
                if not (rank == 0 and chunk == 0):
                    actions.append(Action(RECV_F, mb, chunk))
                actions.append(Action(F, mb, chunk))
                if not (rank == pp_size - 1 and chunk == vp - 1):
                    actions.append(Action(SEND_F, mb, chunk))
    return lists


def build_schedule(name: str, pp_size: int, num_microbatches: int,
                   vp: int = 1) -> list[list[Action]]:
    """Action lists for every pipeline rank: ``lists[pp_rank]`` is that rank's program."""
    for label, value in (("pp_size", pp_size), ("num_microbatches", num_microbatches), ("vp", vp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"build_schedule: {label} must be a positive integer, got {value!r}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        if vp < 2:
            raise ValueError(
                f"the interleaved schedule needs --virtual-pipeline-size >= 2 (got {vp}); "
                f"use --pipeline-schedule 1f1b for one chunk per rank")
        if pp_size < 2:
            raise ValueError("the interleaved schedule needs --pp >= 2; with pp=1 use 1f1b, vp=1")
        if num_microbatches % pp_size != 0:
            raise ValueError(
                f"the interleaved schedule needs the number of micro-batches per step "
                f"({num_microbatches}) to be a multiple of --pp ({pp_size}); choose "
                f"--global-batch-size so that global/(micro*dp) is a multiple of {pp_size}, "
                f"or use --pipeline-schedule 1f1b")
        return [_interleaved(pp_size, num_microbatches, vp, r) for r in range(pp_size)]
    if vp != 1:
        raise ValueError(f"virtual pipeline stages (vp={vp}) need --pipeline-schedule interleaved")
    build = _gpipe if name == "gpipe" else _one_f_one_b
    return [build(pp_size, num_microbatches, r) for r in range(pp_size)]


# ---- checking and replay ----------------------------------------------------------------------

class ScheduleError(ValueError):
    """A schedule that would compute wrong gradients, mismatch transfers or deadlock."""


def _peer(action: Action, rank: int, pp: int, vp: int) -> tuple[int, tuple]:
    """(peer pp rank, message id) of a transfer; the id names the stage boundary it crosses."""
    stage = action.chunk * pp + rank
    if action.kind in (SEND_F, RECV_B):
        boundary, peer = stage, (rank + 1) % pp             # between stage and stage + 1
    else:
        boundary, peer = stage - 1, (rank - 1) % pp         # between stage - 1 and stage
    if not 0 <= boundary < pp * vp - 1:
        raise ScheduleError(f"rank {rank}: {action!r} crosses no stage boundary (virtual stage "
                            f"{stage} of {pp * vp})")
    stream = "activation" if action.kind in (SEND_F, RECV_F) else "gradient"
    return peer, (stream, action.microbatch, boundary)


def match_messages(lists: list[list[Action]], vp: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair the k-th send from rank a to rank b with the k-th receive on b from a.

    Returns ``{(rank, index): (peer_rank, peer_index)}``; raises when the message sent is not the
    one the peer expects at that position (the backends match transfers between two ranks in posting
    order, so such a schedule would silently swap tensors).
    """
    pp = len(lists)
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank, actions in enumerate(lists):
        for i, a in enumerate(actions):
            if a.is_comm:
                peer, msg = _peer(a, rank, pp, vp)
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


def replay(lists: list[list[Action]], compute_time: Callable[[int, Action], float],
           p2p_time: float = 0.0) -> list[list[tuple[float, float]]]:
    """Replay the program as the executor runs it: (start, end) of every action on every rank.

    Compute actions run back to back on their rank. A batch of consecutive transfers is posted when
    the rank reaches it and ends when every transfer in it has both sides posted (plus
    ``p2p_time``): a receive needs the peer's send, and a send is waited for too. Raises
    ``ScheduleError`` on deadlock, naming what each blocked rank waits for.
    """
    pp = len(lists)
    vp = 1 + max(a.chunk for actions in lists for a in actions)
    partner = match_messages(lists, vp)
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
                stop = pos[r]
                while stop < len(actions) and actions[stop].is_comm:
                    posted.setdefault((r, stop), clock[r])
                    stop += 1
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
            detail = "; ".join(f"rank {r} waits at {a!r} for rank {pr} to post {lists[pr][pi]!r}"
                               for r, (a, (pr, pi)) in blocked.items())
            raise ScheduleError(f"the schedule deadlocks: {detail}")
    return times


def in_flight_peaks(lists: list[list[Action]]) -> list[int]:
    """Per rank, the most (micro-batch, chunk) activations held between their F and B."""
    peaks = []
    for actions in lists:
        live = peak = 0
        for a in actions:
            live += (a.kind == F) - (a.kind == B)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _check_program(lists: list[list[Action]], pp: int, vp: int, m: int) -> None:
    """Every (micro, chunk) runs F then B once per rank, each wrapped by exactly its transfers."""
    last = pp * vp - 1
    for rank, actions in enumerate(lists):
        where: dict[tuple, int] = {}
        for i, a in enumerate(actions):
            key = (a.kind, a.microbatch, a.chunk)
            if key in where:
                raise ScheduleError(f"rank {rank}: {a!r} appears twice "
                                    f"(positions {where[key]} and {i})")
            where[key] = i
        for micro in range(m):
            for chunk in range(vp):
                stage = chunk * pp + rank
                pos = {k: where.get((k, micro, chunk)) for k in Kind}
                if pos[F] is None or pos[B] is None:
                    raise ScheduleError(f"rank {rank}: micro-batch {micro} chunk {chunk} lacks its "
                                        f"forward or backward")
                if pos[F] > pos[B]:
                    raise ScheduleError(f"rank {rank}: backward of micro-batch {micro} chunk "
                                        f"{chunk} comes before its forward")
                for comm, compute, comes_first, needed in (
                        (RECV_F, F, True, stage > 0), (SEND_F, F, False, stage < last),
                        (RECV_B, B, True, stage < last), (SEND_B, B, False, stage > 0)):
                    if not needed:
                        if pos[comm] is not None:
                            raise ScheduleError(f"rank {rank}: virtual stage {stage} has no "
                                                f"neighbour for {comm.name}({micro},{chunk})")
                        continue
                    if pos[comm] is None or (pos[comm] < pos[compute]) != comes_first:
                        where_ = "before" if comes_first else "after"
                        raise ScheduleError(f"rank {rank}: {comm.name}({micro},{chunk}) must come "
                                            f"{where_} {compute.name}({micro},{chunk})")


def validate_schedule(lists: list[list[Action]]) -> list[int]:
    """Check a schedule and return the peak number of in-flight micro-batches per rank.

    Checks: on every rank and chunk each micro-batch's forward precedes its backward and is wrapped
    by exactly the transfers its virtual stage needs; every send is matched by the neighbour's
    receive of the same message in the same order; and the program cannot deadlock when each batch
    of transfers blocks until every peer has posted its side. In-flight counts the (micro-batch,
    chunk) activations held between F and B: 1F1B keeps at most ``pp - rank``, GPipe all ``m``.
    """
    pp = len(lists)
    if pp == 0 or not all(lists):
        raise ScheduleError("a schedule needs one non-empty action list per pipeline rank")
    actions = [a for rank_actions in lists for a in rank_actions]
    if any(a.microbatch < 0 or a.chunk < 0 for a in actions):
        raise ScheduleError("micro-batch and chunk indices must be >= 0")
    m = 1 + max(a.microbatch for a in actions)
    vp = 1 + max(a.chunk for a in actions)
    _check_program(lists, pp, vp, m)
    replay(lists, lambda rank, action: 1.0)
    return in_flight_peaks(lists)
