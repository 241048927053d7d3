"""Zero-bubble schedules as data: W actions, the V placement, validation and the bubble formulas.

Pure Python: no process group. Every schedule is built for many (p, m), including m = 1 (the
smallest each allows) and m below p, and must pass the validator: each (micro-batch, chunk) runs
F, B and W exactly once in that order, every F and B is wrapped in exactly the transfers its stage
needs (none across the V's turn, which stays on rank p-1), every send is matched, and the
strictest replay (each batch waited as a whole, sends included) cannot deadlock. The equal-cost
replay must give the documented closed forms exactly, and ZB-H1 the paper's (p-1)(T_F+T_B-T_W).
"""
from __future__ import annotations

import pytest

from parallel.pipeline.actions import Schedule
from parallel.pipeline.bubble import simulate, theoretical_bubble
from parallel.pipeline.partition import stage_layers, stage_owner, virtual_stage
from parallel.pipeline.schedules import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                         ScheduleError, build_schedule, chunks_per_rank,
                                         forward_only_schedule, replay_blocking,
                                         validate_schedule)

ZB = ("1f1b-w", "zb-h1", "zb-v")
CASES = [(name, p, m) for name in ZB for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 12, 17)]


def counts(actions, kind):
    return sum(a.kind == kind for a in actions)


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_w_after_its_b_once_per_chunk_and_peaks(name, p, m):
    lists = build_schedule(name, p, m)
    vp = chunks_per_rank(name)
    assert len(lists) == p and lists.placement == ("v" if name == "zb-v" else "loop")
    for rank, actions in enumerate(lists):
        for micro in range(m):
            for chunk in range(vp):
                where = {a.kind: i for i, a in enumerate(actions)
                         if (a.microbatch, a.chunk) == (micro, chunk) and not a.is_comm}
                assert [counts([a for a in actions if (a.microbatch, a.chunk) == (micro, chunk)], k)
                        for k in (F, B, W)] == [1, 1, 1], (rank, micro, chunk)
                assert where[F] < where[B] < where[W], (rank, micro, chunk)
    peaks = validate_schedule(lists)
    if name == "1f1b-w":                              # 1F1B's bound: F to W holds no longer
        assert peaks == [min(p - rank, m) for rank in range(p)]
    elif name == "zb-h1":                             # the most 1F1B holds (rank 0), on every rank
        assert peaks == [min(p, m)] * p
    else:                                             # chunks are half a stage: p stages' worth
        assert max(peaks) <= 2 * p
        if m >= 2 * p - 1:
            assert peaks == [2 * p] * p


@pytest.mark.parametrize("name,p,m", CASES)
def test_equal_cost_bubble_is_the_formula(name, p, m):
    lists = build_schedule(name, p, m)
    sim = simulate(lists, 1.0, 1.0, wgt_time=1.0)
    assert sim.idle_fraction == pytest.approx(theoretical_bubble(name, p, m), abs=1e-12)


def test_formulas_by_hand():
    # 1F1B idles 3(p-1) units of a rank's 3m; zb-h1 p-1 (a third), zb-v p-1 of 6m (two chunks)
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("1f1b-w", 4, 8) == pytest.approx(6 / 30)
    assert theoretical_bubble("zb-h1", 4, 8) == pytest.approx(3 / 27)
    assert theoretical_bubble("zb-v", 4, 8) == pytest.approx(3 / 51)
    assert theoretical_bubble("zb-h1", 4, 2) == pytest.approx(5 / 11)    # m < p: e = p - m
    assert theoretical_bubble("zb-v", 4, 2) == pytest.approx(1 - 12 / 22)  # 4(m+p)-2 bound
    assert theoretical_bubble("zb-v", 1, 5) == 0.0
    # at pp=2 the zb-v bubble is under half of 1F1B's from m = 2 on
    for m in range(2, 33):
        assert theoretical_bubble("zb-v", 2, m) <= theoretical_bubble("1f1b", 2, m) / 2


@pytest.mark.parametrize("costs", [(1.0, 1.2, 0.6), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0),
                                   (2.0, 1.0, 0.3)])
def test_zb_h1_idles_the_papers_formula(costs):
    """Qi et al. 2024, sec. 3.1: a rank idles (p-1)(T_F + T_B - T_W) for T_W <= T_F and m >= p;
    1f1b-w idles (p-1)(T_F + T_B)."""
    f, b, w = costs
    for p in (2, 3, 4, 8):
        for m in (p, p + 1, 2 * p + 3):
            zb = simulate(build_schedule("zb-h1", p, m), f, b, wgt_time=w)
            assert zb.makespan - m * (f + b + w) == pytest.approx((p - 1) * (f + b - w))
            split = simulate(build_schedule("1f1b-w", p, m), f, b, wgt_time=w)
            assert split.makespan - m * (f + b + w) == pytest.approx((p - 1) * (f + b))


def test_v_placement_and_its_turn():
    assert [virtual_stage(r, c, 4, "v") for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(stage_owner(virtual_stage(r, c, 4, "v"), 4, "v") == (r, c)
               for r in range(4) for c in (0, 1))
    assert stage_layers(8, 2, 2, 0, placement="v") == [range(0, 2), range(6, 8)]
    assert stage_layers(8, 2, 2, 1, placement="v") == [range(2, 4), range(4, 6)]
    lists = build_schedule("zb-v", 2, 4)
    # rank 0 holds stage 0 (no input to receive) and the last stage (no gradient to receive); the
    # turn from stage 1 to stage 2 stays on rank 1: no transfer crosses it
    assert counts(lists[0], RECV_F) == counts(lists[0], SEND_B) == 4           # chunk 1 only
    assert counts(lists[0], SEND_F) == counts(lists[0], RECV_B) == 4           # chunk 0 only
    assert all(a.chunk == 0 for a in lists[1] if a.kind in (RECV_F, SEND_B))
    assert all(a.chunk == 1 for a in lists[1] if a.kind in (SEND_F, RECV_B))
    with pytest.raises(ValueError, match="must be 1 or 2"):
        build_schedule("zb-v", 2, 4, vp=3)
    only = forward_only_schedule(2, 2, 2, "v")
    replay_blocking(only, lambda rank, action: 1.0)             # matched, cannot hang
    assert [repr(a) for a in only[1] if not a.is_comm] == ["F(0,0)", "F(0,1)", "F(1,0)", "F(1,1)"]


def test_phase_orders():
    def order(actions):
        return " ".join(f"{a.kind.name}{a.microbatch}" + (f".{a.chunk}" if a.chunk else "")
                        for a in actions if not a.is_comm)
    zb = build_schedule("zb-h1", 2, 3)
    assert order(zb[0]) == "F0 F1 B0 W0 F2 B1 W1 B2 W2"
    assert order(zb[1]) == "F0 B0 F1 B1 W0 F2 B2 W1 W2"               # W held back by one
    assert order(build_schedule("1f1b-w", 2, 3)[1]) == "F0 B0 W0 F1 B1 W1 F2 B2 W2"
    assert order(build_schedule("zb-v", 2, 2)[0]) == \
        "F0 F1 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 B1 W1"


def test_validator_catches_broken_w_and_turns():
    lists = build_schedule("zb-h1", 2, 2)

    def edited(rank, fn):
        out = [list(a) for a in lists]
        out[rank] = fn(out[rank])
        return Schedule(out, "edited", lists.placement)

    def swap(actions, x, y):
        i, j = actions.index(x), actions.index(y)
        actions[i], actions[j] = actions[j], actions[i]
        return actions

    with pytest.raises(ScheduleError, match=r"W\(0,0\) runs before its B"):
        validate_schedule(edited(1, lambda a: swap(a, Action(B, 0), Action(W, 0))))
    with pytest.raises(ScheduleError, match="has no W"):
        validate_schedule(edited(1, lambda a: [x for x in a if x != Action(W, 1)]))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate_schedule(edited(0, lambda a: a + [Action(W, 0)]))
    v = build_schedule("zb-v", 2, 2)
    turn = [list(a) for a in v]
    turn[1].insert(turn[1].index(Action(F, 0, 0)) + 1, Action(SEND_F, 0, 0))
    with pytest.raises(ScheduleError, match="neighbour on this rank"):
        validate_schedule(Schedule(turn, "zb-v", "v"))
    late = [list(a) for a in v]
    late[1] = swap(late[1], Action(F, 0, 0), Action(F, 0, 1))
    with pytest.raises(ScheduleError, match=r"F\(0,1\) needs F\(0,0\)"):
        validate_schedule(Schedule(late, "zb-v", "v"))
    # a plain list of lists is read with the loop placement, where the V's transfers are wrong
    with pytest.raises(ScheduleError):
        validate_schedule([list(a) for a in v])
