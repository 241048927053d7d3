"""The replay with measured transfers and the exposed transfer time, on a schedule computed by hand
(pure: no process group).

GPipe, p=2, m=2; F costs 1 s, B 2 s; posting a transfer occupies its rank 0.1 s; a receive of an
activation costs 0.5 s and of a gradient 0.3 s from the later of both sides having posted it
and the compute needing it. By hand (rank 0's
program F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1, rank 1's RECV_F0 F0 RECV_F1 F1 B0 SEND_B0
B1 SEND_B1):

    rank 0: F0 0-1, post 1-1.1, F1 1.1-2.1, post 2.1-2.2, post RECV_B0 2.2-2.3, wait 2.3-6.6,
            B0 6.6-8.6, post RECV_B1 8.6-8.7, wait 8.7-9.0, B1 9.0-11.0
    rank 1: post RECV_F0 0-0.1, wait 0.1-1.6 (F0 of rank 0 posted at 1.1, + 0.5), F0 1.6-2.6,
            post 2.6-2.7, wait 2.7-3.2, F1 3.2-4.2, B0 4.2-6.2, post 6.2-6.3, B1 6.3-8.3,
            post 8.3-8.4, wait for its sends 8.4-9.0 (rank 0 posted RECV_B1 at 8.7, + 0.3)

Makespan 11, busy 6 + 6: the bubble is 1 - 12/22 = 10/22; free transfers give GPipe's 1/3.
Exposed (posts, plus each wait after its message was ready): rank 0 0.4 + 0.3 + 0.3 = 1.0,
rank 1 0.4 + 0.5 + 0.5 + 0.3 = 1.7.
"""
from __future__ import annotations

import pytest

from parallel.pipeline.bubble import measured_bubble, simulate, theoretical_bubble
from parallel.pipeline.schedules import build_schedule
from parallel.pipeline.transfers import StageTransfers, TransferSpan, exposure

LISTS = build_schedule("gpipe", 2, 2)
COSTS = StageTransfers(post=[0.1, 0.1], latency_f=[0.0, 0.5], latency_b=[0.3, 0.0])
# the hand timeline's transfer spans: (kind, start, end, indices into the rank's program)
SPANS = [
    [TransferSpan("post", 1.0, 1.1, (1,)), TransferSpan("post", 2.1, 2.2, (3,)),
     TransferSpan("post", 2.2, 2.3, (4,)), TransferSpan("wait", 2.3, 6.6, (4,)),
     TransferSpan("post", 8.6, 8.7, (6,)), TransferSpan("wait", 8.7, 9.0, (6,))],
    [TransferSpan("post", 0.0, 0.1, (0,)), TransferSpan("wait", 0.1, 1.6, (0,)),
     TransferSpan("post", 2.6, 2.7, (2,)), TransferSpan("wait", 2.7, 3.2, (2,)),
     TransferSpan("post", 6.2, 6.3, (5,)), TransferSpan("post", 8.3, 8.4, (7,)),
     TransferSpan("wait", 8.4, 9.0, (5, 7))],
]
COMPUTE = [[("forward", 0.0, 1.0), ("forward", 1.1, 2.1), ("backward", 6.6, 8.6),
            ("backward", 9.0, 11.0)],
           [("forward", 1.6, 2.6), ("forward", 3.2, 4.2), ("backward", 4.2, 6.2),
            ("backward", 6.3, 8.3)]]


def test_the_programs_are_the_ones_computed_by_hand():
    assert [repr(a) for a in LISTS[0]] == ["F(0,0)", "SEND_F(0,0)", "F(1,0)", "SEND_F(1,0)",
                                           "RECV_B(0,0)", "B(0,0)", "RECV_B(1,0)", "B(1,0)"]
    assert [repr(a) for a in LISTS[1]] == ["RECV_F(0,0)", "F(0,0)", "RECV_F(1,0)", "F(1,0)",
                                           "B(0,0)", "SEND_B(0,0)", "B(1,0)", "SEND_B(1,0)"]


def test_replay_with_transfers_matches_the_hand_timeline():
    p2p, post = COSTS.costs(LISTS)
    sim = simulate(LISTS, 1.0, 2.0, p2p, post_time=post)
    spans = [[(repr(a), round(s, 9), round(e, 9)) for a, s, e in rank] for rank in sim.timings]
    assert spans[1][1] == ("F(0,0)", 1.6, 2.6)
    assert spans[1][3] == ("F(1,0)", 3.2, 4.2)
    assert spans[0][4] == ("RECV_B(0,0)", 2.2, 6.6)      # post start to completion
    assert spans[0][5] == ("B(0,0)", 6.6, 8.6)
    assert spans[0][7] == ("B(1,0)", 9.0, 11.0)
    assert spans[1][7] == ("SEND_B(1,0)", 8.3, 9.0)
    assert sim.makespan == pytest.approx(11.0)
    assert sim.idle_fraction == pytest.approx(10 / 22)
    free = simulate(LISTS, 1.0, 2.0)
    assert free.idle_fraction == pytest.approx(theoretical_bubble("gpipe", 2, 2)) == 1 / 3


def test_exposure_recovers_the_transfer_costs_from_the_spans():
    got = exposure(LISTS, SPANS)
    assert got.exposed == pytest.approx([1.0, 1.7])
    assert got.stages.post == pytest.approx([0.1, 0.1])
    # rank 1's activations cost 0.5 s each, rank 0's gradients 0.3 s; a wait for sends is no
    # receive's
    assert got.stages.latency_f == pytest.approx([0.0, 0.5])
    assert got.stages.latency_b == pytest.approx([0.3, 0.0])


def test_measured_and_simulated_bubbles_reconcile_on_the_hand_timeline():
    """The measurement of the hand timeline (transfers + idle at the ends, over the phase) is the
    replay's bubble with the transfer costs the spans give back: the terms add up exactly."""
    events = [[{"cat": cat, "start": s, "end": e} for cat, s, e in compute] +
              [{"cat": "comm", "start": t.start, "end": t.end} for t in spans]
              for compute, spans in zip(COMPUTE, SPANS)]
    measured = measured_bubble(events).mean
    p2p, post = exposure(LISTS, SPANS).stages.costs(LISTS)
    assert measured == pytest.approx(simulate(LISTS, 1.0, 2.0, p2p, post_time=post).idle_fraction)
    assert measured == pytest.approx(10 / 22)


def test_a_message_ready_before_the_wait_exposes_only_what_followed():
    """A wait that starts before the peer posted waits for the peer (bubble) until then, and only
    the rest is transfer time; one whose data arrived before the wait exposes nothing, and counts
    in the mean cost per receive as 0."""
    spans = [[TransferSpan("post", 1.0, 1.0, (1,)), TransferSpan("post", 2.1, 2.1, (3,)),
              TransferSpan("post", 2.2, 2.2, (4,)), TransferSpan("wait", 2.2, 6.5, (4,)),
              TransferSpan("post", 8.6, 8.6, (6,))],              # B1's gradient already there
             [TransferSpan("post", 0.0, 0.0, (0,)), TransferSpan("wait", 0.0, 1.2, (0,)),
              TransferSpan("post", 2.6, 2.6, (2,)), TransferSpan("post", 6.2, 6.2, (5,)),
              TransferSpan("post", 8.3, 8.3, (7,))]]
    got = exposure(LISTS, spans)
    assert got.exposed == pytest.approx([0.3, 0.2])           # 6.5 - 6.2 and 1.2 - 1.0
    assert got.stages.latency_b == pytest.approx([0.15, 0.0])
    assert got.stages.latency_f == pytest.approx([0.0, 0.1])
    assert got.stages.post == pytest.approx([0.0, 0.0])
