"""The planner's ZeRO-3 (engine/plan/zero3.py): parameter bytes 1/dp, the gathered peak, the
gathers' bytes and their overlap, the search proposing ZeRO-3 where nothing else fits, and the
memory check at start estimating a ZeRO-3 run. Every expected figure is computed here from the
model's own parameter count (the formulas below), not by the planner's functions."""
from dataclasses import replace

import pytest

from engine.config.cli import parse_args
from engine.plan import search as plan
from engine.plan.collectives import gather_or_scatter_s
from engine.plan.hardware import DEVICE_SPECS, OverlapEfficiency
from engine.plan.memory import memory_per_device
from engine.plan.model import GIB, Cluster, Layout, ModelShape
from engine.plan.traffic import step_traffic
from engine.plan.zero3 import gather_overlap
from engine.training.memory_check import memory_problem, planner_inputs

# gpt2, 4 layers, h 256, vocabulary 1000 (padded to 1024), seq 128, global batch 16
H, S, V_PAD = 256, 128, 1024
SHAPE = ModelShape(4, H, 8, 1000, S, 16)
LAYER = 12 * H * H + 13 * H            # QKV, projection, fc1, fc2 and their biases, two norms
EMBED, POS, NORM = V_PAD * H, S * H, 2 * H
N = 4 * LAYER + EMBED + POS + NORM     # 3,454,464: the tied output layer adds nothing


def zero3(dp: int, **kw) -> Layout:
    return Layout(1, 1, dp, micro_batch_size=2, zero=True, zero_stage=3, **kw)


@pytest.mark.parametrize("dp", [2, 4])
def test_parameters_gradients_and_state_take_one_dp_th(dp):
    """bf16 weights 2N/dp, fp32 gradient shards 4N/dp, masters and moments 12N/dp; ZeRO-1 keeps
    the whole 2N and 4N."""
    mem = memory_per_device(SHAPE, zero3(dp))
    assert (mem.weights, mem.grads, mem.optimizer) == (2 * N / dp, 4 * N / dp, 12 * N / dp)
    one = memory_per_device(SHAPE, Layout(1, 1, dp, micro_batch_size=2, zero=True))
    assert (one.weights, one.grads, one.gathered) == (2 * N, 4 * N, 0.0)


def test_the_gathered_peak_is_the_kept_units_and_three_layers():
    """The tied embedding and the position table are kept gathered (whole), and the backward
    holds three consecutive units at once: 2 x (EMBED + POS + 3 LAYER) bytes, 5,328,384, the
    peak the engine's own ZeRO-3 store reaches in the dry run of this model at any dp. Untied
    (llama), the embedding is an ordinary unit and three layers are the largest run."""
    assert memory_per_device(SHAPE, zero3(2)).gathered == 2 * (EMBED + POS + 3 * LAYER) == 5_328_384
    llama = replace(SHAPE, block="llama", ffn_hidden_size=4 * H)
    layer = 4 * H * H + 3 * H * 4 * H + 2 * H      # attention, gate/up/down, two RMSNorms
    assert memory_per_device(llama, zero3(4)).gathered == 2 * 3 * layer


@pytest.mark.parametrize("dp", [2, 4])
def test_gather_bytes_two_per_unit_and_micro_batch(dp):
    """dp_comm_bytes: the fp32 gradients' reduce-scatter (4N) plus each unit's shard gathered in
    every forward and again in every backward (layers and the final norm, 2 m times), the kept
    units once; ZeRO-1 gathers every shard once."""
    m = SHAPE.global_batch_size // (2 * dp)
    gathers = 2 * (2 * m * (4 * LAYER + NORM) + EMBED + POS) / dp
    assert step_traffic(SHAPE, zero3(dp), 0)["dp"] == pytest.approx(4 * N + gathers, rel=1e-12)
    one = Layout(1, 1, dp, micro_batch_size=2, zero=True)
    assert step_traffic(SHAPE, one, 0)["dp"] == pytest.approx(4 * N + 2 * N / dp, rel=1e-12)


def _overlap(efficiency: float, forward: float, backward: float, gather_param: bool = True):
    cluster = Cluster.from_device(DEVICE_SPECS["a100-80gb"], 8,
                                  overlap=OverlapEfficiency(1.0, 1.0, efficiency))
    lay = zero3(8, overlap_param_gather=gather_param)
    return gather_overlap(SHAPE, cluster, lay, 100.0, 0.0, lambda stage, unit: (forward, backward))


def test_gathers_hide_under_the_unit_before_them():
    """Units [layers 0-3, final norm, output (tied: nothing of its own)], m = 1 at dp 8. With
    compute far longer than a gather and full efficiency only the first unit of each pass waits:
    layer 0 forward, the output's nothing backward, and the kept embedding and position table once
    a step. With no compute beside them, or efficiency 0, or the prefetch off, all of it waits."""
    g = lambda params: gather_or_scatter_s(2 * params, 8, 100.0)  # noqa: E731
    kept, layers, norm = g(EMBED) + g(POS), 4 * g(LAYER), g(NORM)
    every = 2 * (layers + norm) + kept
    hidden = _overlap(1.0, 1.0, 1.0)
    assert hidden.exposed == pytest.approx(g(LAYER) + kept, rel=1e-12)
    assert hidden.total == pytest.approx(every, rel=1e-12)
    for case in (_overlap(1.0, 0.0, 0.0), _overlap(0.0, 1.0, 1.0), _overlap(1.0, 1.0, 1.0, False)):
        assert case.exposed == pytest.approx(every, rel=1e-12) and case.hidden == pytest.approx(0.0)


# llama, 56 layers x 6144 (about 26B parameters) on 8 H100s, tp = pp = 1: ZeRO-2 holds
# 2 + 14/8 = 3.75 bytes per parameter (98 GB), ZeRO-3 18/8 = 2.25 (59 GB) of 77 GB usable
BIG = ModelShape(56, 6144, 48, 32000, 2048, 64, block="llama", fused_attention=True, dropout=False)
H100X8 = Cluster.from_device(DEVICE_SPECS["h100"], 8)


def test_the_search_proposes_zero3_where_nothing_else_fits():
    pinned = plan.SearchSpace(tp=1, pp=1)
    assert plan.search(BIG, H100X8, replace(pinned, zero_stages=(1, 2), offload=(0.0,))) == []
    best = plan.search(BIG, H100X8, pinned)[0]
    assert best.layout.zero_stage == 3 and best.layout.offload == 0 and best.fits
    # ZeRO-2 with the optimizer in host memory also fits, and is slower (the host's update)
    offloaded = plan.search(BIG, H100X8, replace(pinned, zero_stages=(1, 2)))[0]
    assert offloaded.layout.offload == 1.0 and offloaded.step_time_s > best.step_time_s
    assert best.time.zero_allgather > 0 and best.memory.gathered > 0


def test_the_search_keeps_zero1_where_it_fits():
    """More sharding is weighed only where a layout does not fit: the small model stays ZeRO-1."""
    small = plan.search(SHAPE, Cluster.from_device(DEVICE_SPECS["h100"], 8), plan.SearchSpace(tp=1, pp=1))
    assert small and all(e.layout.zero_stage == 1 and not e.layout.offload for e in small)


def _cfg(*flags):
    return parse_args(["--mock-data", "--vocab-size", "32000", "--num-layers", "56", "--hidden-size",
                       "6144", "--num-attention-heads", "48", "--seq-length", "2048", "--block",
                       "llama", "--micro-batch-size", "1", "--global-batch-size", "64",
                       "--precision", "bf16", "--recompute", "full", *flags])


def test_the_start_memory_check_accepts_a_run_that_fits_only_with_zero3():
    """At dp 8 the same model: ZeRO-2 is refused with one line, ZeRO-3 starts; the check's bytes
    are the planner's (ZeRO-3: 2.25 bytes per parameter and the gathered units)."""
    z2 = _cfg("--dp", "8", "--data-parallel-sharding-strategy", "optim_grads")
    z3 = _cfg("--dp", "8", "--data-parallel-sharding-strategy", "optim_grads_params")
    grid = z3.parallel.grid(8)
    available = int(80 * GIB)
    problem = memory_problem(z2, grid, 0, available, "on the device", "nccl")
    assert problem and "more than" in problem and "\n" not in problem
    assert memory_problem(z3, grid, 0, available, "on the device", "nccl") is None
    shape, layout = planner_inputs(z3, grid)
    assert layout.zero3 and memory_per_device(shape, layout).weights == 2 * _params(shape) / 8
    short = int(memory_per_device(shape, layout, "nccl").total) - 1   # one byte short: refused
    assert memory_problem(z3, grid, 0, short, "on the device", "nccl")


def _params(shape: ModelShape) -> float:
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_hidden
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return shape.num_layers * layer + 2 * shape.padded_vocab(1) * h + h
