"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): each backward
is split into B (the input gradient, on the critical path) and W (the weight gradients, deferrable),
and W fills what would be idle time.

Each builder returns one rank's order of compute steps, ``(kind, micro, chunk)``;
``timeline_programs`` adds the transfers. With ``p`` ranks and ``m`` micro-batches:

- ``1f1b-w``: 1F1B with every B followed at once by its W. The same timeline as 1F1B; it exists to
  compare the split with the fused backward on one schedule.
- ``zb-h1`` (the paper's ZB-H1, its Figure 3): 1F1B's warm-up of ``p - 1 - r`` forwards on rank
  ``r``, then one forward and one B per step, but rank ``r`` holds its W back by ``r`` micro-batches
  and runs the held-back ones after its last B. Only B travels the critical path back through the
  stages, so the cool-down waits shrink, and the W held back fill them. A micro-batch's activations
  live from its F to its W, at most ``min(p, m)`` on every rank: the most 1F1B holds (on rank 0).
- ``zb-v`` (the paper's ZB-V, section 6): two chunks per rank in a V (chunk 0 on stages 0..p-1,
  chunk 1 on stages 2p-1..p; ``partition.virtual_stage(placement="v")``). Warm-up on rank ``r``:
  ``2 (p - r) - 1`` chunk-0 forwards, ``r`` pairs (chunk-1 F, chunk-0 F), ``p - r`` triples (chunk-1
  F, B, W); steady state (F, B, W on chunk 0, then on chunk 1); cool-down ``r`` pairs of B (chunk 0,
  chunk 1), ``p - r`` pairs (chunk-0 B, its oldest W), then the remaining W of chunk 1 and of chunk 0.
  The construction is the one the paper gives and PyTorch's ``ScheduleZBVZeroBubble`` implements
  (torch/distributed/pipelining/schedules.py): it is written for ``m >= 2p - 1`` and, for smaller
  ``m``, built for ``2p - 1`` micro-batches with the ones past ``m`` left out (every ordering
  constraint survives the removal; ``validate_schedule`` checks each case). Peak activations:
  at most ``2p`` (micro-batch, chunk) pairs on any rank, each half a stage: ``p`` stages' worth,
  1F1B's; rank 0 holds that many once ``m >= 2p - 1`` (below, a later rank holds the most:
  ``p = 4, m = 4`` gives 5, 6, 7, 8 on ranks 0-3; ``in_flight_peaks`` has each rank's).

Transfers (``timeline_programs``). The orders above come from a timeline in which sends never wait
and a compute step waits only for its own input. The programs keep that: each send is posted right
after the step that produced it, each receive in the batch the receiving rank reaches when the
message leaves its sender in the timeline of equal-cost steps, and the executor waits for a receive
only before the step that consumes it (executor.py). The pairing by time is what keeps a schedule
whose two neighbours send to each other at once (the V: rank r sends rank r+1 chunk 0's
activations and chunk 1's gradients, and receives the opposite pair) free of deadlock on backends
that run a batch as one group and complete it only when every peer has posted its side (NCCL,
HCCL): a send and the receives that cross it sit in batches posted at the same moment.
"""
from __future__ import annotations

from parallel.pipeline.actions import (B, BATCH_ORDER, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                       Kind, neighbour)
from parallel.pipeline.partition import virtual_stage

Order = list[tuple[Kind, int, int]]


def delayed_w_order(pp: int, m: int, rank: int, delay: int) -> Order:
    """1F1B's order of F and B with each W ``delay`` micro-batches after its B (0: right after).

    >>> " ".join(f"{k.name}{i}" for k, i, _ in delayed_w_order(2, 3, 1, delay=1))
    'F0 B0 F1 B1 W0 F2 B2 W1 W2'
    """
    warmup = min(pp - 1 - rank, m)
    order: Order = [(F, i, 0) for i in range(warmup)]
    f, b, w = warmup, 0, 0
    while b < m:
        if f < m:
            order.append((F, f, 0))
            f += 1
        order.append((B, b, 0))
        b += 1
        if b - w > delay:
            order.append((W, w, 0))
            w += 1
    order += [(W, i, 0) for i in range(w, m)]
    return order


def one_f_one_b_w_order(pp: int, m: int, rank: int) -> Order:
    return delayed_w_order(pp, m, rank, delay=0)


def zb_h1_order(pp: int, m: int, rank: int) -> Order:
    return delayed_w_order(pp, m, rank, delay=rank)


def zb_v_order(pp: int, m: int, rank: int) -> Order:
    """ZB-V's order of one rank (see the module docstring); chunk 1 is the way back up.

    >>> " ".join(f"{k.name}{i}.{c}" for k, i, c in zb_v_order(2, 3, 1))
    'F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 W1.1 B1.0 B2.1 B2.0 W1.0 W2.1 W2.0'
    """
    n = max(2 * pp - 1, m)
    order: Order = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        order.append((F, f0, 0))
        f0 += 1
    for _ in range(rank):
        order += [(F, f1, 1), (F, f0, 0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(pp - rank):
        order += [(F, f1, 1), (B, b1, 1), (W, b1, 1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append((F, f0, 0))
            f0 += 1
        order += [(B, b0, 0), (W, b0, 0), (F, f1, 1), (B, b1, 1), (W, b1, 1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        order += [(B, b0, 0), (B, b1, 1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        order += [(B, b0, 0), (W, w0, 0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [(W, i, 1) for i in range(w1, b1)]
    order += [(W, i, 0) for i in range(w0, b0)]
    assert f0 == f1 == b0 == b1 == n, (pp, m, rank, f0, f1, b0, b1)
    return [step for step in order if step[1] < m]


def equal_cost_timeline(orders: list[Order], pp: int, vp: int,
                        placement: str) -> list[list[tuple[float, float]]]:
    """(start, end) of every compute step when each takes one unit, sends never wait and a step
    waits only for its input: F for the previous virtual stage's F of that micro-batch, B for the
    next stage's B (on the last stage, its own F, earlier in the order)."""
    last = pp * vp - 1
    pos, clock = [0] * pp, [0.0] * pp
    ends: dict[tuple, float] = {}
    times: list[list] = [[None] * len(order) for order in orders]
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, micro, chunk = orders[r][pos[r]]
                stage = virtual_stage(r, chunk, pp, placement)
                dep = (F, micro, stage - 1) if kind == F and stage > 0 else \
                    (B, micro, stage + 1) if kind == B and stage < last else None
                if dep is not None and dep not in ends:
                    break
                start = max(clock[r], ends[dep] if dep is not None else 0.0)
                ends[(kind, micro, stage)] = clock[r] = start + 1.0
                times[r][pos[r]] = (start, start + 1.0)
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError("the compute orders wait on each other: no step can run")
    return times


def timeline_programs(orders: list[Order], pp: int, vp: int, placement: str) -> list[list[Action]]:
    """Each rank's program: its compute steps, every send right after the step that produced it,
    every receive in the batch the rank reaches when the message leaves its sender in the
    equal-cost timeline (never after the step that consumes it). Inside a batch sends come first,
    then receives in the order their messages were sent."""
    times = equal_cost_timeline(orders, pp, vp, placement)
    batches = [[[] for _ in range(len(order) + 1)] for order in orders]  # before step i; i = len: end
    for rank, order in enumerate(orders):
        for i, (kind, micro, chunk) in enumerate(order):
            if kind == W:
                continue
            other = neighbour(rank, chunk, pp, vp, placement, +1 if kind == F else -1)
            if other is None or other[0] == rank:
                continue                                    # an end of the pipeline, or the V's turn
            sent = times[rank][i][1]
            send, recv = (SEND_F, RECV_F) if kind == F else (SEND_B, RECV_B)
            batches[rank][i + 1].append(((0, BATCH_ORDER[send]), Action(send, micro, chunk)))
            peer, peer_chunk = other
            at = sum(1 for _, end in times[peer] if end <= sent)
            consumer = orders[peer].index((kind, micro, peer_chunk))
            batches[peer][min(at, consumer)].append(((1, sent, BATCH_ORDER[recv]),
                                                     Action(recv, micro, peer_chunk)))
    lists = []
    for rank, order in enumerate(orders):
        program: list[Action] = []
        for i in range(len(order) + 1):
            program += [a for _, a in sorted(batches[rank][i], key=lambda item: item[0])]
            if i < len(order):
                program.append(Action(*order[i]))
        lists.append(program)
    return lists
