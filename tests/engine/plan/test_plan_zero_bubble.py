"""The planner's zero-bubble schedules: bubble, activations in flight, device 0 of the V, and the
launch command. The bubble formula with equal forward, input-gradient and weight-gradient times
must be the schedule replay's own (parallel/pipeline/bubble.py), and the in-flight counts the
validator's peaks of the very schedule the engine runs."""
from __future__ import annotations

import shlex

import pytest

from engine.plan.model import Cluster, Layout, ModelShape, check_layout
from engine.plan.memory import in_flight, memory_per_device, stage_params
from engine.plan.hardware import DEVICE_SPECS
from engine.plan.report import launch_command
from engine.plan.timing import PassTime, estimate, pipeline_bubble_s
from parallel.pipeline.bubble import theoretical_bubble
from parallel.pipeline.schedules import build_schedule, validate_schedule

SHAPE = ModelShape(48, 8192, 64, 51200, 2048, 1536)


def cluster(devices):
    return Cluster.from_device(DEVICE_SPECS["a100-80gb"], devices)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_equal_costs_give_the_replayed_bubble(schedule):
    mean = PassTime(compute=3.0, backward=2.0, weight=1.0)     # T_F = T_B = T_W = 1
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, 5, 8, 16, 33):
            idle = pipeline_bubble_s(Layout(1, p, 1, schedule=schedule), m, mean)
            fraction = idle / (m * mean.total + idle)
            assert fraction == pytest.approx(theoretical_bubble(schedule, p, m), abs=1e-12)


def test_zb_h1_is_the_papers_bubble_for_unequal_costs():
    mean = PassTime(compute=3.0, backward=1.8, weight=0.8)     # T_F 1.2, T_B 1.0, T_W 0.8
    assert pipeline_bubble_s(Layout(1, 4, 1, schedule="zb-h1"), 8, mean) == pytest.approx(3 * 1.4)
    assert pipeline_bubble_s(Layout(1, 4, 1), 8, mean) == pytest.approx(3 * 3.0)


def test_in_flight_is_the_schedules_peak():
    for p, m in ((2, 1), (4, 3), (4, 8), (8, 5), (8, 40)):
        shape = ModelShape(8 * p, 64, 4, 100, 32, m)
        h1 = Layout(1, p, 1, schedule="zb-h1")
        assert [in_flight(shape, h1, r) for r in range(p)] == [min(p, m)] * p
        v = Layout(1, p, 1, schedule="zb-v")
        peaks = validate_schedule(build_schedule("zb-v", p, m))
        assert [in_flight(shape, v, r) for r in range(p)] == [k / 2 for k in peaks]


def test_v_places_both_ends_on_device_0():
    shape = ModelShape(16, 1024, 8, 50000, 1024, 64)
    v = Layout(1, 4, 1, schedule="zb-v")
    assert v.vp == 2 and v.pipeline_schedule == "zb-v"
    first, last = stage_params(shape, v)
    plain_first, plain_last = stage_params(shape, Layout(1, 4, 1))
    # device 0 adds the final norm (2h) and no output matrix (tied: the embedding itself); the
    # last device keeps its blocks only, without the tied copy (V h) and the final norm
    assert first == plain_first + 2 * 1024
    assert last == plain_last - shape.padded_vocab(1) * 1024 - 2 * 1024  # V padded to 128s
    mem = memory_per_device(shape, v)
    assert mem.stage == "first" and mem.pipeline_ends > 0
    assert check_layout(shape, cluster(4), Layout(1, 4, 1, schedule="zb-v")) is None
    assert "not divisible by pp*vp = 8" in check_layout(ModelShape(12, 1024, 8, 50000, 1024, 64),
                                                        cluster(4), v)
    assert "zb-v needs pp > 1" in check_layout(shape, cluster(1), Layout(1, 1, 1, schedule="zb-v"))
    with pytest.raises(ValueError, match="zb-v runs 2 chunks"):
        Layout(1, 4, 1, vp=3, schedule="zb-v")


def test_zero_bubble_estimates_and_command():
    c = cluster(512)
    one = estimate(SHAPE, c, Layout(8, 4, 16, micro_batch_size=1, recompute="full"))
    h1 = estimate(SHAPE, c, Layout(8, 4, 16, micro_batch_size=1, recompute="full", schedule="zb-h1"))
    v = estimate(SHAPE, c, Layout(8, 4, 16, micro_batch_size=1, recompute="full", schedule="zb-v"))
    # full recomputation runs in B, so W is a small part of the backward: ZB-H1 saves T_W per
    # stage of the 1F1B bubble, ZB-V about half of the rest
    assert v.time.bubble < h1.time.bubble < one.time.bubble
    assert h1.memory.activations == pytest.approx(one.memory.activations)   # device 0 holds p
    from engine.config.cli import parse_args
    argv = shlex.split(launch_command(SHAPE, v.layout, 8))
    cfg = parse_args(argv[argv.index("engine.train") + 1:])
    assert cfg.parallel.pipeline_schedule == "zb-v" and cfg.parallel.chunks_per_rank == 2
