"""Pipeline schedules as data: partitioning, action lists, validation, bubble and timelines.

Pure Python: no process group. The executor runs these same lists (tests/parallel/pipeline/test_pipeline_executor.py).
"""
from __future__ import annotations

import json

import pytest

from parallel.pipeline.bubble import (measured_bubble, phase_times, rank_bubble, simulate,
                                      theoretical_bubble)
from parallel.pipeline.partition import partition_layers, stage_layers
from parallel.pipeline.actions import batches, message
from parallel.pipeline.schedules import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action,
                                         ScheduleError, build_schedule, validate_schedule)
from parallel.pipeline.timeline import TimelineEvent, chrome_trace, write_chrome_trace

CASES = ([("gpipe", p, m, 1) for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)]
         + [("1f1b", p, m, 1) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 12)]
         + [("interleaved", p, m, v) for p in (2, 3, 4) for v in (2, 3, 4)
            for m in (p, 2 * p, 4 * p)])


def compute_order(actions):
    return " ".join(f"{a.kind.name}{a.microbatch}" + (f".{a.chunk}" if a.chunk else "")
                    for a in actions if a.kind in (F, B))


# ---- partition --------------------------------------------------------------------------------

def test_partition_balanced_and_interleaved():
    assert partition_layers(8, pp=4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition_layers(8, pp=2, vp=2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(8, pp=2, vp=2, pp_rank=1) == [range(2, 4), range(6, 8)]
    # uneven: the ends give up the spare layers first
    assert [len(r) for r in partition_layers(10, pp=4)] == [2, 3, 3, 2]
    assert [len(r) for r in partition_layers(7, pp=1)] == [7]
    for layers, pp, vp in [(13, 4, 1), (24, 4, 3), (9, 3, 3), (30, 8, 1)]:
        parts = partition_layers(layers, pp, vp)
        assert len(parts) == pp * vp
        assert [i for r in parts for i in r] == list(range(layers))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_partition_first_last_weight():
    assert [len(r) for r in partition_layers(8, pp=4, first_last_weight=2.0)] == [1, 3, 3, 1]
    assert [len(r) for r in partition_layers(10, pp=4, first_last_weight=1.0)] == [2, 3, 3, 2]
    assert [len(r) for r in partition_layers(7, pp=3, first_last_weight=0.5)] == [2, 3, 2]
    # the embedding sits on virtual stage 0, the head on the last: both on chunk ends
    parts = partition_layers(16, pp=2, vp=2, first_last_weight=2.0)
    assert [len(r) for r in parts] == [3, 5, 5, 3]
    # every stage keeps at least one layer even when the ends are very heavy
    assert [len(r) for r in partition_layers(4, pp=4, first_last_weight=10)] == [1, 1, 1, 1]


def test_partition_of_a_billion_layers():
    """The least bound is found by bisection, not by scanning every layer count (minutes for the
    memory check at start, which plans the run's split): ends 1 layer lighter, so the bound is
    250,000,001 and the two surplus layers come off the ends."""
    counts = [len(r) for r in partition_layers(10 ** 9, 4, first_last_weight=1.0)]
    assert counts == [249_999_999, 250_000_001, 250_000_001, 249_999_999]


def test_partition_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"3 layers into pp\*vp = 2\*2 = 4.*--num-layers >= 4"):
        partition_layers(3, pp=2, vp=2)
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        partition_layers(4, pp=0)
    with pytest.raises(ValueError, match="first_last_weight"):
        partition_layers(4, pp=2, first_last_weight=-1)
    with pytest.raises(ValueError, match="pp_rank"):
        stage_layers(8, pp=2, vp=1, pp_rank=2)


# ---- schedules --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_shape_and_validity(name, p, m, v):
    lists = build_schedule(name, p, m, v)
    assert len(lists) == p
    last = p * v - 1
    for rank, actions in enumerate(lists):
        count = {k: sum(a.kind == k for a in actions)
                 for k in (F, B, RECV_F, SEND_F, RECV_B, SEND_B)}
        assert count[F] == count[B] == m * v
        firsts = m if rank == 0 else 0                  # virtual stage 0 receives nothing
        lasts = m if rank == p - 1 else 0               # the last virtual stage sends nothing on
        assert count[RECV_F] == count[SEND_B] == m * v - firsts
        assert count[SEND_F] == count[RECV_B] == m * v - lasts
        assert all(0 <= a.chunk * p + rank <= last for a in actions)
    peaks = validate_schedule(lists)
    if name == "gpipe":
        assert peaks == [m] * p
    elif name == "1f1b":
        assert peaks == [min(p - rank, m) for rank in range(p)]
    else:   # Megatron: warmup 2(p-rank-1) + (v-1)p forwards, then one more before the first B
        assert peaks == [min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) for rank in range(p)]


def test_phase_orders():
    assert compute_order(build_schedule("gpipe", 2, 3)[0]) == "F0 F1 F2 B0 B1 B2"
    one_f_one_b = build_schedule("1f1b", 4, 6)
    assert compute_order(one_f_one_b[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert compute_order(one_f_one_b[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert compute_order(build_schedule("1f1b", 4, 2)[0]) == "F0 F1 B0 B1"      # m < p
    inter = build_schedule("interleaved", 2, 4, 2)
    assert compute_order(inter[0]) == ("F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 "
                                       "B2.1 B3.1 B2 B3")
    assert compute_order(inter[1]) == ("F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 "
                                       "F3.1 B3.1 B2 B3")


@pytest.mark.parametrize("name,p,m,v", CASES + [(n, p, m, 2 if n == "zb-v" else 1)
                                                for n in ("zb-v", "zb-h1", "1f1b-w")
                                                for p in (2, 3, 4) for m in (p, 2 * p)])
def test_every_batch_sends_to_and_receives_from_each_peer_at_most_once(name, p, m, v):
    """HcclBatchSendRecv takes one send to and one receive from each peer per call: the batches
    the executor posts (actions.batches) never hold two, and cut a run of transfers only there."""
    lists = build_schedule(name, p, m, v)
    placement, vp = getattr(lists, "placement", "loop"), 1 + max(a.chunk for x in lists for a in x)
    for rank, actions in enumerate(lists):
        bounds = batches(actions, rank, p, vp, placement)
        assert [i for a, b in bounds for i in range(a, b)] == \
            [i for i, a in enumerate(actions) if a.is_comm]                   # every transfer once
        for a, b in bounds:
            keys = [(x.kind in (SEND_F, SEND_B), message(x, rank, p, vp, placement)[0])
                    for x in actions[a:b]]
            assert len(set(keys)) == len(keys), (rank, actions[a:b])
            if b < len(actions) and actions[b].is_comm:    # a cut inside a run: only where needed
                nxt = actions[b]
                assert (nxt.kind in (SEND_F, SEND_B), message(nxt, rank, p, vp, placement)[0]) \
                    in keys


def test_interleaved_pp2_cuts_the_steps_that_send_both_ways_to_the_one_peer():
    """With pp=2 both neighbours are one peer: rank 0's warmup step sends micro-batch 2's
    activation, micro-batch 0's gradient and receives micro-batch 1's gradient, two batches; the
    peer posts the matching pair of batches, and the schedule still validates (no deadlock when
    every batch is waited for whole)."""
    lists = build_schedule("interleaved", 2, 4, 2)
    runs = [sum(1 for i, a in enumerate(x) if a.is_comm and (i == 0 or not x[i - 1].is_comm))
            for x in lists]
    cut = [len(batches(x, r, 2, 2, "loop")) for r, x in enumerate(lists)]
    assert all(c > n for c, n in zip(cut, runs)), (cut, runs)
    validate_schedule(lists)


def test_steady_state_batches_pair_send_and_receive():
    """1F1B's steady state posts send_forward+recv_backward and send_backward+recv_forward."""
    actions = build_schedule("1f1b", 3, 4)[1]
    text = " ".join(repr(a) for a in actions)
    assert "F(1,0) SEND_F(1,0) RECV_B(0,0) B(0,0) RECV_F(2,0) SEND_B(0,0)" in text


def test_schedule_errors_are_clear():
    with pytest.raises(ValueError, match=r"multiple of --pp \(4\)"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual-pipeline-size >= 2"):
        build_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match="need --pipeline-schedule interleaved"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 4, 8)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        build_schedule("gpipe", 2, 0)


def test_validate_catches_broken_schedules():
    lists = build_schedule("1f1b", 2, 2)
    backward_first = [list(lists[0]), lists[1]]
    i, j = backward_first[0].index(Action(F, 1)), backward_first[0].index(Action(B, 1))
    backward_first[0][i], backward_first[0][j] = backward_first[0][j], backward_first[0][i]
    with pytest.raises(ScheduleError, match="before its forward"):
        validate_schedule(backward_first)

    gpipe = build_schedule("gpipe", 2, 2)
    swapped = [list(gpipe[0]), gpipe[1]]
    i, j = swapped[0].index(Action(SEND_F, 0)), swapped[0].index(Action(SEND_F, 1))
    swapped[0][i], swapped[0][j] = Action(SEND_F, 1), Action(SEND_F, 0)
    with pytest.raises(ScheduleError, match="must come after|expects"):
        validate_schedule(swapped)

    reordered = [[Action(F, 0), Action(F, 1), Action(SEND_F, 1), Action(SEND_F, 0),
                  Action(RECV_B, 0), Action(B, 0), Action(RECV_B, 1), Action(B, 1)], gpipe[1]]
    with pytest.raises(ScheduleError, match="message 0 from rank 0 to rank 1"):
        validate_schedule(reordered)

    deadlock = [[Action(F, 0), Action(SEND_F, 0), Action(F, 1), Action(RECV_B, 0), Action(B, 0),
                 Action(SEND_F, 1), Action(RECV_B, 1), Action(B, 1)],
                [Action(RECV_F, 0), Action(F, 0), Action(RECV_F, 1), Action(F, 1), Action(B, 0),
                 Action(SEND_B, 0), Action(B, 1), Action(SEND_B, 1)]]
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at RECV_B"):
        validate_schedule(deadlock)

    stray = [list(gpipe[0]) + [Action(SEND_B, 0)], gpipe[1]]
    with pytest.raises(ScheduleError, match="no neighbour"):
        validate_schedule(stray)


# ---- bubble -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,v", CASES)
def test_simulated_bubble_equals_theory(name, p, m, v):
    lists = build_schedule(name, p, m, v)
    theory = theoretical_bubble(name, p, m, v)
    for bwd_ratio in (1.0, 2.0):
        sim = simulate(lists, 1.0, bwd_ratio)
        assert sim.idle_fraction == pytest.approx(theory, abs=1e-12)
        assert sim.makespan == pytest.approx((v * m + p - 1) * (1.0 + bwd_ratio))


def test_bubble_formulas():
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b", 1, 8) == 0.0
    # Megatron-LM: bubble / ideal = (1/v)(p-1)/m, i.e. bubble / total = (p-1)/(v m + p - 1)
    p, m, v = 8, 16, 4
    ratio = (p - 1) / (v * m)
    assert theoretical_bubble("interleaved", p, m, v) == pytest.approx(ratio / (1 + ratio))
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        theoretical_bubble("pipedream", 2, 2)


def test_simulate_costs_and_transfer_time():
    lists = build_schedule("1f1b", 2, 2)
    base = simulate(lists, 1.0, 2.0)
    slow = simulate(lists, 1.0, 2.0, p2p_time=0.5)
    assert slow.makespan > base.makespan
    uneven = simulate(lists, [1.0, 3.0], [2.0, 6.0])    # stage 1 three times slower
    assert uneven.idle_per_rank[0] > uneven.idle_per_rank[1]
    assert uneven.makespan == pytest.approx(1.0 + 2 * (3.0 + 6.0) + 2.0)
    with pytest.raises(ValueError, match="one per rank"):
        simulate(lists, [1.0, 2.0, 3.0], 1.0)


def test_measured_bubble_from_events():
    """Per rank: transfers + idle outside its own phase, over the pipeline's longest phase; only
    durations enter, so a rank whose clock is another host's (shifted) gives the same figures."""
    def ev(rank, cat, start, end):
        return TimelineEvent(rank, cat[0].upper(), cat, start, end)
    events = [[ev(0, "forward", 0, 1), ev(0, "comm", 1, 3), ev(0, "backward", 3, 5)],
              [ev(1, "comm", 0.5, 1), ev(1, "forward", 1, 2), ev(1, "backward", 2, 4)]]
    measured = measured_bubble(events)
    assert measured.span == 5.0
    # rank 0: 2 s in the transfer; rank 1: 0.5 s before its first action, 0.5 s in the transfer,
    # 1 s after its last action
    assert measured.per_rank == pytest.approx([0.4, 0.4])
    assert measured.wait_per_rank == pytest.approx([0.4, 0.1])
    assert measured.mean == pytest.approx(0.4)
    flat = [e for rank_events in events for e in rank_events]
    assert measured_bubble(flat).per_rank == pytest.approx([0.4, 0.4])
    shifted = [events[0], [ev(1, e.cat, e.start + 1000.0, e.end + 1000.0) for e in events[1]]]
    assert measured_bubble(shifted).per_rank == pytest.approx([0.4, 0.4])
    # host time between actions (Python, launches) is not pipeline idle
    gaps = [[ev(0, "forward", 0, 1), ev(0, "backward", 1.5, 2.5)]]
    assert measured_bubble(gaps).per_rank == [0.0]
    assert rank_bubble(phase_times(gaps[0]), 3.5) == pytest.approx(1 / 3.5)


# ---- timeline and chart -----------------------------------------------------------------------

def test_chrome_trace_and_gantt(tmp_path):
    events = [[TimelineEvent(0, "F0.0", "forward", 100.0, 100.5, 0, 0),
               TimelineEvent(0, "optimizer", "optimizer", 101.0, 101.2)],
              [TimelineEvent(1, "RECV_F(0,0)", "comm", 100.0, 100.5),
               TimelineEvent(1, "F0.0", "forward", 100.5, 101.0, 0, 0)]]
    trace = write_chrome_trace(str(tmp_path / "t.json"), events)
    loaded = json.loads((tmp_path / "t.json").read_text())
    assert loaded == trace
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["ts"], e["dur"]) for e in spans] == [
        (0, "F0.0", 0.0, 500000.0), (0, "optimizer", 1000000.0, 200000.0),
        (1, "RECV_F(0,0)", 0.0, 500000.0), (1, "F0.0", 500000.0, 500000.0)]
    assert spans[0]["args"] == {"microbatch": 0, "chunk": 0}
    names = [e for e in chrome_trace(events)["traceEvents"] if e["name"] == "thread_name"]
    assert [e["args"]["name"] for e in names] == ["rank 0", "rank 1"]

    pytest.importorskip("matplotlib")
    from benchmarks.pipeline.gantt import draw_gantt
    sim = simulate(build_schedule("interleaved", 2, 4, 2), 0.5, 1.0)
    assert (tmp_path / "sim.png").name in draw_gantt(sim, str(tmp_path / "sim.png"), "sim")
    draw_gantt(events, str(tmp_path / "events.png"), "events")
    assert (tmp_path / "sim.png").stat().st_size > 0
    assert (tmp_path / "events.png").stat().st_size > 0
