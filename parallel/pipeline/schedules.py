"""Pipeline schedules as data: one ordered list of actions per pipeline rank.

A schedule is built once per step shape ``(schedule, pp, num_microbatches, vp)`` and run by
``executor.run_schedule``; the same lists feed ``validate_schedule`` (ordering, matching, deadlock
freedom; replay.py), ``bubble.simulate`` (a timing replay) and the Gantt charts, so what is tested
and drawn is exactly what runs. The vocabulary (kinds, ``Action``, ``Schedule``, ``RankProgram``)
is actions.py; the zero-bubble orders are zero_bubble.py.

Consecutive transfer actions form one batch that the executor posts with a single
``batch_isend_irecv`` and waits for as a whole, cut where a batch would hold two sends to, or two
receives from, one peer (actions.py ``batches``: HCCL refuses them). GPipe, 1F1B and the zero-bubble
schedules wrap each compute action in its transfers (``RECV_F F SEND_F``, ``RECV_B B SEND_B``; a
``W`` has none), so 1F1B's steady state yields Megatron's ``send_forward_recv_backward`` and
``send_backward_recv_forward`` batches. The interleaved schedule follows Megatron's one batch per
step (send what was produced, receive the next forward's input and the next backward's gradient);
with pp=2, where both neighbours are one peer, a step that sends (or receives) both an activation
and a gradient posts its transfers as two batches. Inside a run actions are ordered
activations first, gradients second, sends before receives, on every rank, and the backends pair
the messages between two ranks in posting order.

| name | chunks per rank | placement | backward |
| --- | --- | --- | --- |
| gpipe, 1f1b | 1 | - | B computes input and weight gradients |
| interleaved | vp >= 2 | loop (stage ``chunk * pp + rank``) | B |
| 1f1b-w, zb-h1 | 1 | - | B, then W |
| zb-v | 2 | V (chunk 0 down the ranks, chunk 1 back up) | B, then W |

Validation runs ``forward_only_schedule``: a placement's training forward order without its
backward passes and gradient transfers, pipelined as in training.
"""
from __future__ import annotations

from parallel.pipeline.actions import (B, COMM_KINDS, F, RECV_B, RECV_F, SEND_B,
                                       SEND_F, W, Action, Kind, RankProgram, Schedule,
                                       has_weight_actions, placement_of)
from parallel.pipeline.replay import (ScheduleError, in_flight_peaks, match_messages, replay,
                                      replay_blocking, validate_schedule)
from parallel.pipeline.zero_bubble import (Order, one_f_one_b_w_order, timeline_programs,
                                          zb_h1_order, zb_v_order)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "1f1b-w", "zb-h1", "zb-v")


def chunks_per_rank(name: str, vp: int = 1) -> int:
    """Model chunks one rank holds under schedule ``name``: 2 for zb-v, vp otherwise."""
    return 2 if name == "zb-v" else vp


def schedule_placement(name: str) -> str:
    """The chunk placement a schedule runs with: "v" for zb-v, "loop" otherwise."""
    return "v" if name == "zb-v" else "loop"




# ---- the schedules ----------------------------------------------------------------------------

def _gpipe(pp: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards: every micro-batch's activations are held at once."""
    rb = RankProgram(pp, rank)
    for micro in range(m):              # forward phase (warmup: the whole batch)
        rb.forward(micro)
    for micro in range(m):              # backward phase (cooldown)
        rb.backward(micro)
    return rb.done()


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """PipeDream-flush / Megatron 1F1B: at most ``pp - rank`` micro-batches in flight on a rank."""
    rb = RankProgram(pp, rank)
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


def interleaved_forward(pp: int, vp: int, k: int) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's ``k``-th forward under the interleaved schedule: the
    micro-batches go in groups of ``pp``, each group through chunk 0, then chunk 1, ...

    >>> [interleaved_forward(2, 2, k) for k in range(6)]
    [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0)]
    """
    group = pp * vp
    return (k // group) * pp + k % pp, (k % group) // pp


def _interleaved(pp: int, m: int, vp: int, rank: int) -> list[Action]:
    """Megatron interleaved 1F1B: each rank holds ``vp`` chunks; micro-batches go in groups of pp.

    The k-th forward on a rank runs chunk ``(k % (pp*vp)) // pp`` on micro-batch
    ``(k // (pp*vp)) * pp + k % pp``; backwards visit the chunks in reverse order. Transfers follow
    Megatron: after each forward (warmup), forward+backward pair (steady) or backward (cooldown) one
    batch sends what was produced and receives the inputs of the next forward and next backward.
    """
    last_stage = pp * vp - 1
    total = m * vp
    warmup = min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
    steady = total - warmup

    def fwd(k: int) -> tuple[int, int]:           # (micro, chunk) of the k-th forward
        return interleaved_forward(pp, vp, k)

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


def forward_order(pp: int, m: int, vp: int, placement: str, rank: int) -> Order:
    """Rank ``rank``'s forwards in the order its training schedule runs them, without the backward
    and weight passes: the interleaved order (groups of ``pp`` micro-batches, chunk by chunk;
    micro-batches past ``m`` left out when ``m`` is not a multiple of ``pp``) for the loop
    placement, which is plain micro-batch order when vp = 1, and ZB-V's F order for the V."""
    if placement == "v":
        return [step for step in zb_v_order(pp, m, rank) if step[0] == F]
    groups = -(-m // pp)
    steps = (interleaved_forward(pp, vp, k) for k in range(groups * pp * vp))
    return [(F, micro, chunk) for micro, chunk in steps if micro < m]


def forward_only_schedule(pp_size: int, num_microbatches: int, vp: int = 1,
                          placement: str = "loop") -> Schedule:
    """Forwards and activation transfers only (validation): the training schedule's forward order
    (``forward_order``), pipelined as in training, transfers placed by the equal-cost timeline
    (zero_bubble.py ``timeline_programs``: each send right after its forward, each receive in the
    batch its rank reaches when the message leaves). ``validate_schedule(lists, forward_only=True)``
    proves it matched and free of deadlock. The executor keeps each boundary tensor only while it
    is in flight: a received input until its forward, an output until its send is posted or the
    next chunk on the rank has taken it (executor.py)."""
    for label, value in (("pp_size", pp_size), ("num_microbatches", num_microbatches), ("vp", vp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"forward_only_schedule: {label} must be a positive integer, "
                             f"got {value!r}")
    if placement == "v" and vp != 2:
        raise ValueError(f"the V placement runs two model chunks per rank, got vp={vp}")
    orders = [forward_order(pp_size, num_microbatches, vp, placement, r) for r in range(pp_size)]
    return Schedule(timeline_programs(orders, pp_size, vp, placement), "forward-only", placement)


def _from_order(order_fn, pp: int, m: int, vp: int, placement: str) -> list[list[Action]]:
    """Programs from each rank's order of compute steps, transfers placed by the timeline."""
    return timeline_programs([order_fn(pp, m, rank) for rank in range(pp)], pp, vp, placement)


_ORDERS = {"1f1b-w": one_f_one_b_w_order, "zb-h1": zb_h1_order, "zb-v": zb_v_order}


def build_schedule(name: str, pp_size: int, num_microbatches: int, vp: int = 1) -> Schedule:
    """Action lists for every pipeline rank: ``lists[pp_rank]`` is that rank's program.

    ``vp`` is the number of model chunks per rank for the interleaved schedule; zb-v always runs
    two (in the V placement) and accepts vp 1 or 2.
    """
    for label, value in (("pp_size", pp_size), ("num_microbatches", num_microbatches), ("vp", vp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"build_schedule: {label} must be a positive integer, got {value!r}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    m = num_microbatches
    if name == "interleaved":
        if vp < 2:
            raise ValueError(
                f"the interleaved schedule needs --virtual-pipeline-size >= 2 (got {vp}); "
                f"use --pipeline-schedule 1f1b for one chunk per rank")
        if pp_size < 2:
            raise ValueError("the interleaved schedule needs --pp >= 2; with pp=1 use 1f1b, vp=1")
        if m % pp_size != 0:
            raise ValueError(
                f"the interleaved schedule needs the number of micro-batches per step "
                f"({m}) to be a multiple of --pp ({pp_size}); choose "
                f"--global-batch-size so that global/(micro*dp) is a multiple of {pp_size}, "
                f"or use --pipeline-schedule 1f1b")
        return Schedule([_interleaved(pp_size, m, vp, r) for r in range(pp_size)], name)
    if name == "zb-v":
        if vp not in (1, 2):
            raise ValueError(f"zb-v runs two model chunks per rank in a V; --virtual-pipeline-size "
                             f"must be 1 or 2 with it, got {vp}")
        return Schedule(_from_order(zb_v_order, pp_size, m, 2, "v"), name, "v")
    if vp != 1:
        raise ValueError(f"virtual pipeline stages (vp={vp}) need --pipeline-schedule interleaved")
    if name in _ORDERS:
        return Schedule(_from_order(_ORDERS[name], pp_size, m, 1, "loop"), name)
    build = _gpipe if name == "gpipe" else _one_f_one_b
    return Schedule([build(pp_size, m, r) for r in range(pp_size)], name)
