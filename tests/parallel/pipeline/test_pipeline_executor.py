"""The pipeline executor on real gloo ranks against the serial model.

Toy model: a stack of Linear+tanh layers created identically from a seed on every rank, split into
stages by ``partition_layers``; the loss is the mean over micro-batches of an MSE. Every schedule
must reproduce the serial loss and the serial gradients of the layers each rank holds.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.nn as nn

from parallel.pipeline.executor import _backward, _free_output, run_schedule, sum_embedding_grads
from parallel.pipeline.p2p import PipelineCommError, init_p2p
from parallel.pipeline.partition import stage_layers
from parallel.pipeline.schedules import build_schedule, validate_schedule
from parallel.pipeline.timeline import gather_events, write_chrome_trace
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.stream_check import stream_checked

SEED = 1234
MICRO_BATCH = 3


def make_layers(widths: list[int]) -> list[nn.Module]:
    torch.manual_seed(SEED)
    return [nn.Sequential(nn.Linear(widths[i], widths[i + 1]), nn.Tanh())
            for i in range(len(widths) - 1)]


def make_data(widths: list[int], m: int):
    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(m, MICRO_BATCH, widths[0], generator=gen)    # (m, b, h0)
    y = torch.randn(m, MICRO_BATCH, widths[-1], generator=gen)   # (m, b, hL)
    return x, y


def serial_reference(widths: list[int], m: int):
    """Loss and per-layer gradients of the whole model, one micro-batch at a time."""
    layers = make_layers(widths)
    model = nn.Sequential(*layers)
    x, y = make_data(widths, m)
    total = 0.0
    for i in range(m):
        loss = nn.functional.mse_loss(model(x[i]), y[i]) / m
        loss.backward()
        total += loss.item()
    return total, [[p.grad.clone() for p in layer.parameters()] for layer in layers]


def pipeline_step(ps, widths, schedule, m, vp, first_last_weight=0.0, shape_fn=False,
                  timeout_s=30.0):
    """Run one schedule on this rank; returns (result, {layer index: grads})."""
    num_layers = len(widths) - 1
    layers = make_layers(widths)
    ranges = stage_layers(num_layers, ps.pp_size, vp, ps.pp_rank, first_last_weight)
    chunks = [nn.Sequential(*(layers[i] for i in r)) for r in ranges]
    x, y = make_data(widths, m)
    last_chunk_is_last_stage = ps.is_last_stage

    def forward_step(chunk, micro, inp):
        h = chunks[chunk](x[micro] if inp is None else inp)          # (b, h)
        if last_chunk_is_last_stage and chunk == vp - 1:
            return nn.functional.mse_loss(h, y[micro]) / m
        return h

    if shape_fn:
        shape = lambda chunk, micro: (MICRO_BATCH, widths[ranges[chunk].start])  # noqa: E731
    else:
        shape = (MICRO_BATCH, widths[0])
    lists = build_schedule(schedule, ps.pp_size, m, vp)
    result = run_schedule(ps, lists, chunks, forward_step, m, shape, torch.float32, timeout_s)
    grads = {i: [p.grad.clone() for p in layers[i].parameters()] for r in ranges for i in r}
    return result, lists, grads


def check_equivalence(ps, widths, configs, shape_fn):
    report = []
    for schedule, m, vp, weight in configs:
        ref_loss, ref_grads = serial_reference(widths, m)
        result, lists, grads = pipeline_step(ps, widths, schedule, m, vp, weight, shape_fn)
        label = f"{schedule} pp={ps.pp_size} m={m} vp={vp} w={weight} rank {ps.rank}"
        if ps.is_last_stage:
            assert len(result.losses) == m, label
            assert result.loss == pytest.approx(ref_loss, rel=1e-5), label
        else:
            assert result.losses == [], label
        assert result.peak_in_flight == validate_schedule(lists)[ps.pp_rank], label
        assert grads, label
        for i, layer_grads in grads.items():
            for got, want in zip(layer_grads, ref_grads[i]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=label)
        report.append(label)
    return report


def check_embedding_sum(ps):
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), float(ps.pp_rank + 1))
    q = nn.Parameter(torch.zeros(2))             # no grad yet: counts as zero
    sum_embedding_grads(ps, [p, q])
    ends = 1 + ps.pp_size
    want = float(ends) if ps.pp_rank in (0, ps.pp_size - 1) else float(ps.pp_rank + 1)
    assert torch.equal(p.grad, torch.full((3,), want)), (ps.rank, p.grad)
    if ps.pp_rank in (0, ps.pp_size - 1):
        assert torch.equal(q.grad, torch.zeros(2))


def check_timeline(ps, out_dir):
    """The events are this rank's schedule, action by action, in order and without overlap."""
    widths = [6] * 9
    result, lists, _ = pipeline_step(ps, widths, "1f1b", 8, 1)
    compute = [e for e in result.events if e.cat in ("forward", "backward")]
    want = [f"{a.kind.name}{a.microbatch}.{a.chunk}" for a in lists[ps.pp_rank] if not a.is_comm]
    assert [e.name for e in compute] == want, (ps.rank, [e.name for e in compute])
    comm_runs = sum(1 for i, a in enumerate(lists[ps.pp_rank])
                    if a.is_comm and (i == 0 or not lists[ps.pp_rank][i - 1].is_comm))
    posted = [e for e in result.events if e.cat == "comm" and not e.name.startswith("wait")]
    assert len(posted) == comm_runs
    # a receive not needed right after its batch is waited for just before the step using it
    for a, b in zip(result.events, result.events[1:]):
        if a.name.startswith("wait ") and a.name != "wait sends":
            assert b.name == a.name[len("wait "):], (ps.rank, a.name, b.name)
    for a, b in zip(result.events, result.events[1:]):
        assert a.start <= a.end <= b.start, (ps.rank, a, b)
    assert result.wait_s == pytest.approx(sum(e.end - e.start for e in result.events
                                              if e.cat == "comm"))
    gathered = gather_events(ps, result.events)
    if ps.rank == 0:
        assert len(gathered) == ps.world_size
        path = os.path.join(out_dir, "trace.json")
        write_chrome_trace(path, gathered)
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)["traceEvents"]
        spans = [e for e in trace if e["ph"] == "X"]
        assert {e["tid"] for e in spans} == set(range(ps.world_size))
        # one span per event of every rank, in microseconds from the earliest event
        origin = min(e["start"] for rank_events in gathered for e in rank_events)
        for rank, rank_events in enumerate(gathered):
            want = [(e["name"], (e["start"] - origin) * 1e6, (e["end"] - e["start"]) * 1e6)
                    for e in sorted(rank_events, key=lambda e: e["start"])]
            got = [(e["name"], e["ts"], e["dur"]) for e in spans if e["tid"] == rank]
            assert [n for n, _, _ in got] == [n for n, _, _ in want], rank
            for (_, ts, dur), (_, want_ts, want_dur) in zip(got, want):
                assert ts == pytest.approx(want_ts, abs=1e-3) and dur == pytest.approx(want_dur, abs=1e-3)


def pp4_checks(ps, out_dir):
    init_p2p(ps)
    widths = [8] * 9                                   # 8 layers
    configs = [("gpipe", 3, 1, 0.0), ("gpipe", 6, 1, 0.0), ("1f1b", 2, 1, 0.0),
               ("1f1b", 5, 1, 1.0), ("1f1b", 8, 1, 0.0), ("interleaved", 4, 2, 0.0),
               ("interleaved", 8, 2, 0.0)]
    report = check_equivalence(ps, widths, configs, shape_fn=False)
    check_embedding_sum(ps)
    check_timeline(ps, out_dir)
    return report


def expect_comm_error(ps, fail_stage: int, timeout_s: float):
    """Stage ``fail_stage`` raises in its second forward; the others must name it in their error."""
    widths = [5] * 5
    layers = make_layers(widths)
    ranges = stage_layers(4, ps.pp_size, 1, ps.pp_rank)
    chunk = nn.Sequential(*(layers[i] for i in ranges[0]))
    x, _ = make_data(widths, 4)

    def forward_step(c, micro, inp):
        if ps.pp_rank == fail_stage and micro == 1:
            raise ValueError("injected failure")
        h = chunk(x[micro] if inp is None else inp)
        return h.sum() / 4 if ps.is_last_stage else h

    try:
        run_schedule(ps, build_schedule("1f1b", ps.pp_size, 4), [chunk], forward_step, 4,
                     (MICRO_BATCH, 5), torch.float32, timeout_s)
    except (ValueError, PipelineCommError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def pp2_dp2_checks(ps):
    widths = [4, 7, 5, 9, 6, 8, 3]                     # 6 layers, every boundary its own shape
    configs = [("gpipe", 1, 1, 0.0), ("gpipe", 3, 1, 0.0), ("1f1b", 1, 1, 0.0),
               ("1f1b", 3, 1, 1.0), ("interleaved", 2, 2, 0.0), ("interleaved", 4, 2, 0.0),
               ("interleaved", 2, 3, 0.0)]
    report = check_equivalence(ps, widths, configs, shape_fn=True)
    check_embedding_sum(ps)
    # stage 1 fails at micro-batch 1; stage 0 must name it within the timeout, which on a loaded
    # 2-core machine (4 ranks) took longer than 2 s once
    report.append(expect_comm_error(ps, fail_stage=1, timeout_s=10.0))
    return report


def exit_check(ps, out_dir):
    """Stage 1 dies mid-step; stage 0 must fail fast with an error naming stage 1."""
    widths = [5] * 3
    layers = make_layers(widths)
    chunk = nn.Sequential(layers[ps.pp_rank])
    x, _ = make_data(widths, 4)

    def forward_step(c, micro, inp):
        if ps.pp_rank == 1 and micro == 1:
            os._exit(0)                                # the process vanishes, no error report
        h = chunk(x[micro] if inp is None else inp)
        return h.sum() / 4 if ps.is_last_stage else h

    try:
        run_schedule(ps, build_schedule("1f1b", 2, 4), [chunk], forward_step, 4,
                     (MICRO_BATCH, 5), torch.float32, timeout_s=30.0)
        message = "no error"
    except PipelineCommError as exc:
        message = str(exc)
    with open(os.path.join(out_dir, f"{ps.rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"message": message}, f)
    os._exit(0)  # the peer is gone: skip the final barrier, which could only fail


# ---- tests ------------------------------------------------------------------------------------

def test_serial_schedule_and_freed_output_backward():
    torch.manual_seed(0)
    ps = ParallelState.serial()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x, y = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    fs = lambda c, m, inp: nn.functional.mse_loss(model(x[m]), y[m]) / 3  # noqa: E731
    result = run_schedule(ps, build_schedule("1f1b", 1, 3), [model], fs, 3, (2, 4),
                          torch.float32, None)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = sum(nn.functional.mse_loss(model(x[m]), y[m]) / 3 for m in range(3))
    ref.backward()
    assert result.loss == pytest.approx(ref.item(), rel=1e-6)
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=0)
    # Backward through an output whose storage was released after its send.
    inp = torch.randn(2, 4, requires_grad=True)
    out = model(inp)
    grad = torch.randn_like(out)
    assert _free_output(out) and out.numel() == 1
    _backward(out, grad, freed=True)
    freed_grad = inp.grad.clone()
    inp.grad = None
    model(inp).backward(grad)
    assert torch.equal(freed_grad, inp.grad)


def test_run_schedule_rejects_wrong_chunks():
    ps = ParallelState.serial()
    with pytest.raises(ValueError, match="virtual-pipeline-size"):
        run_schedule(ps, build_schedule("interleaved", 2, 2, 2)[0], [nn.Linear(2, 2)],
                     lambda *a: None, 2, (1, 2), torch.float32, 1.0)


def test_pp4_all_schedules_match_serial(tmp_path):
    reports = run_distributed(pp4_checks, grid=RankGrid(pp=4), args=(str(tmp_path),))
    assert all(len(r) == 7 for r in reports)
    assert (tmp_path / "trace.json").exists()


def test_pp2_dp2_schedules_match_serial_and_failure_names_stage():
    """Under HCCL's rules (a batch holds one send to and one receive from each peer): with pp=2
    the interleaved schedule's steps that send an activation and a gradient to the one peer post
    them in two batches."""
    grid = RankGrid(pp=2, dp=2)
    reports = run_distributed(pp2_dp2_checks, grid=grid, timeout_s=60, backend_rules="hccl")
    for rank, report in enumerate(reports):
        failure = report[-1]
        if grid.coord(rank).pp == 1:
            assert failure == "ValueError: injected failure"
        else:
            # stage 1 fails in micro-batch 1's forward, after posting micro-batch 0's gradient;
            # its process then leaves, and a posted gradient its peer had not received yet can
            # go with it (as in a real crash): the peer then names micro-batch 0
            stage1 = grid.rank_of(pp=1, dp=grid.coord(rank).dp)
            assert any(failure.startswith("PipelineCommError: pipeline stage 1 "
                                          f"(rank {stage1}) sent no gradient for micro-batch {m} "
                                          "within 10 s") for m in (0, 1)), failure


def _checked_schedules(ps):
    widths = [4, 7, 5, 9, 6]
    return check_equivalence(ps, widths, [("1f1b", 3, 1, 0.0), ("interleaved", 2, 2, 0.0)],
                             shape_fn=True)


def test_schedules_under_the_stream_checker():
    """Every activation and gradient transfer is posted, waited for and only then read, and no
    sent buffer is written before its send's wait (tests/helpers/stream_check.py)."""
    reports = run_distributed(stream_checked, grid=RankGrid(pp=2), args=(_checked_schedules,))
    assert all(len(r) == 2 for r in reports)


def test_dead_stage_is_named_by_its_neighbour():
    with tempfile.TemporaryDirectory() as out_dir:
        run_distributed(exit_check, grid=RankGrid(pp=2), args=(out_dir,), timeout_s=60,
                        vanishes=True)
        with open(os.path.join(out_dir, "0.json"), encoding="utf-8") as f:
            message = json.load(f)["message"]
    assert message.startswith("pipeline stage 1 (rank 1) failed or disconnected"), message
    # stage 1 vanishes in micro-batch 1's forward, after posting micro-batch 0's gradient, which
    # can leave with the process before stage 0 received it (as in a real crash)
    assert any(f"before sending the gradient of micro-batch {m} " in message for m in (0, 1)), message
