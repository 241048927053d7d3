"""The forward-only (validation) pipeline: its schedule is pipelined and its run keeps only what is
in flight.

Pure part: ``forward_only_schedule`` passes the validator (matched, no backward, no deadlock when
every batch is waited for as a whole) for many (pp, m, vp, placement), and its replay with
equal-cost chunk forwards takes the pipelined forward's time exactly. Spawned part (pp=2, gloo,
one job under the stream-order checker): 1F1B, interleaved and ZB-V forward-only runs of m=8
give the serial losses and hold, at each forward, no earlier micro-batch's boundary tensor; a
training run whose chunk returns a view frees the view's base once sent, with unchanged gradients.
"""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn

from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from parallel.pipeline.actions import neighbour
from parallel.pipeline.executor import run_schedule
from parallel.pipeline.p2p import init_p2p
from parallel.pipeline.partition import stage_layers
from parallel.pipeline.schedules import (F, Action, Schedule, ScheduleError, build_schedule,
                                         forward_only_schedule, forward_order, replay,
                                         validate_schedule)
from tests.helpers.dist_utils import run_distributed
from tests.helpers.stream_check import stream_checked

LAYOUTS = [(1, "loop"), (2, "loop"), (3, "loop"), (4, "loop"), (2, "v")]


# ---- the schedule (pure) ----------------------------------------------------------------------

def makespan(lists, vp: int) -> float:
    """Replay with every chunk forward 1/vp units (a stage's forward is one unit)."""
    times = replay(lists, lambda rank, action: 1.0 / vp)
    return max(end for spans in times for _, end in spans)


@pytest.mark.parametrize("vp,placement", LAYOUTS)
def test_forward_only_schedule_is_valid_and_holds_one_output(vp, placement):
    for pp in (1, 2, 3, 4, 5):
        for m in (1, 2, 3, 5, 8, 13):
            lists = forward_only_schedule(pp, m, vp, placement)
            assert lists.placement == placement
            # every F once with its activation transfers, matched, no deadlock; each output is
            # handed on (sent, or taken by the V's turn) right after its forward
            assert validate_schedule(lists, forward_only=True) == [1] * pp, (pp, m, vp, placement)
            for rank, actions in enumerate(lists):
                assert [(a.kind, a.microbatch, a.chunk) for a in actions if not a.is_comm] \
                    == forward_order(pp, m, vp, placement, rank)


def test_forward_only_is_pipelined():
    """Loop placement: (m vp + pp - 1)/vp units, the interleaved forward's fill and drain. V: each
    rank's chunk-1 work ends (pp - 1)/2 after rank pp-1 starts (its last step is a chunk-1 forward
    whose micro-batch still crosses pp - 1 half stages) and rank pp-1 starts (pp - 1)/2 late, so
    m + pp - 1 is the least any order takes; ZB-V's F order takes it."""
    for pp, m, vp in ((4, 8, 2), (4, 8, 4), (2, 8, 2), (3, 9, 3), (4, 32, 1)):
        assert makespan(forward_only_schedule(pp, m, vp), vp) == pytest.approx((m * vp + pp - 1) / vp)
    for pp, m in ((4, 8), (2, 8), (4, 3), (3, 13)):
        assert makespan(forward_only_schedule(pp, m, 2, "v"), 2) == pytest.approx(m + pp - 1)
    # the training schedules' forward order, backward passes dropped
    assert forward_order(2, 4, 2, "loop", 0) == [(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1),
                                                 (F, 2, 0), (F, 3, 0), (F, 2, 1), (F, 3, 1)]
    assert forward_order(2, 3, 2, "v", 1) == [(F, 0, 0), (F, 0, 1), (F, 1, 0), (F, 1, 1),
                                              (F, 2, 0), (F, 2, 1)]


def test_forward_only_validator_and_errors():
    with pytest.raises(ScheduleError, match="forward-only schedule"):
        validate_schedule(build_schedule("1f1b", 2, 3), forward_only=True)
    lists = forward_only_schedule(2, 2)
    with pytest.raises(ScheduleError, match="lacks its forward"):
        validate_schedule(Schedule([lists[0], [a for a in lists[1] if a != Action(F, 1)]]),
                          forward_only=True)
    with pytest.raises(ScheduleError, match="lacks its forward or backward"):
        validate_schedule(lists)                            # a training schedule needs its B
    with pytest.raises(ValueError, match="two model chunks"):
        forward_only_schedule(2, 4, 1, "v")
    with pytest.raises(ValueError, match="forward_only runs forwards"):
        run_schedule(ParallelState.serial(), build_schedule("1f1b", 1, 2), [nn.Linear(2, 2)], None, 2, (1, 2),
                     torch.float32, None, forward_only=True)


# ---- runs on two gloo ranks -------------------------------------------------------------------

WIDTH, BATCH, LAYERS, M = 6, 3, 8, 8


def toy(seed: int = 7):
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, BATCH, WIDTH, generator=gen)                   # (m, b, h)
    y = torch.randn(M, BATCH, WIDTH, generator=gen)                   # (m, b, h)
    return layers, x, y


def forward_only_retention(ps, name: str):
    """One forward-only run; at each forward, the earlier micro-batches with a boundary tensor
    (an output of this rank or an input it received) still alive."""
    vp = 2 if name != "1f1b" else 1
    placement = "v" if name == "zb-v" else "loop"
    layers, x, y = toy()
    ranges = stage_layers(LAYERS, ps.pp_size, vp, ps.pp_rank, placement=placement)
    chunks = [nn.Sequential(*(layers[i] for i in r)) for r in ranges]
    seen: list[tuple[int, weakref.ref]] = []                          # (micro, tensor)
    alive: list[int] = []

    def forward_step(chunk, micro, inp):
        alive.append(len({mb for mb, ref in seen if mb < micro and ref() is not None}))
        if inp is not None:
            seen.append((micro, weakref.ref(inp)))
        h = chunks[chunk](x[micro] if inp is None else inp)           # (b, h)
        if neighbour(ps.pp_rank, chunk, ps.pp_size, vp, placement, +1) is None:
            return nn.functional.mse_loss(h, y[micro]) / M
        seen.append((micro, weakref.ref(h)))
        return h

    lists = forward_only_schedule(ps.pp_size, M, vp, placement)
    with torch.no_grad():
        result = run_schedule(ps, lists, chunks, forward_step, M, (BATCH, WIDTH), torch.float32,
                              30.0, deallocate_outputs=False, forward_only=True)
    assert result.peak_in_flight == validate_schedule(lists, True)[ps.pp_rank], name
    return alive, result.losses


def view_output_freed(ps, view: bool):
    """A 1F1B training step whose chunk ends in a view: rank 0's sent outputs' bases at each
    forward, and the gradients."""
    layers, x, y = toy()
    chunk = nn.Sequential(*(layers[i] for i in stage_layers(LAYERS, 2, 1, ps.pp_rank)[0]))
    bases: list[weakref.ref] = []
    alive: list[int] = []

    def forward_step(c, micro, inp):
        alive.append(sum(ref() is not None for ref in bases))
        h = chunk(x[micro] if inp is None else inp) * 2.0              # (b, h); saved by no one
        if ps.is_last_stage:
            return nn.functional.mse_loss(h, y[micro]) / M
        bases.append(weakref.ref(h))
        return h.view(BATCH, WIDTH) if view else h

    run_schedule(ps, build_schedule("1f1b", 2, M), [chunk], forward_step, M, (BATCH, WIDTH),
                 torch.float32, 30.0)
    return alive, [p.grad.clone() for p in chunk.parameters()]


def pp2_checks(ps):
    init_p2p(ps)
    report = {name: forward_only_retention(ps, name) for name in ("1f1b", "interleaved", "zb-v")}
    plain, view = view_output_freed(ps, False), view_output_freed(ps, True)
    for got, want in zip(view[1], plain[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    report["view"] = view[0]
    return report


def test_forward_only_keeps_what_is_in_flight_and_views_are_freed():
    reports = run_distributed(stream_checked, grid=RankGrid(pp=2), args=(pp2_checks,))
    layers, x, y = toy()
    model = nn.Sequential(*layers)
    with torch.no_grad():
        serial = [(nn.functional.mse_loss(model(x[i]), y[i]) / M).item() for i in range(M)]
    for name, holder in (("1f1b", 1), ("interleaved", 1), ("zb-v", 0)):
        for rank, report in enumerate(reports):
            alive, losses = report[name]
            assert len(alive) == M * (1 if name == "1f1b" else 2), (name, rank)
            # received inputs are dropped after their forward, outputs once sent (the transfer
            # holds its buffer until the send completes) or taken by the V's turn: before the
            # fix every earlier micro-batch stayed alive (up to M - 1)
            assert max(alive) == 0, (name, rank, alive)
            assert losses == (pytest.approx(serial, rel=1e-6) if rank == holder else []), name
    # rank 0 sends its outputs: a view's base went with it (before: alive until its backward)
    assert reports[0]["view"] == [0] * M, reports[0]["view"]
