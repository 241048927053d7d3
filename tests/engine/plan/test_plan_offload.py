"""The planner's optimizer offload (engine/plan/offload.py): optimizer bytes move from the device
to the host, the copies over the host link and the host's update, the search proposing the
offload for a model one H200 cannot hold otherwise, the calibration of the host rate and the
command line. Expected figures come from the formulas written out here."""
import json
import shlex
from dataclasses import replace

import pytest

from engine.config.cli import parse_args
from engine.plan import search as plan
from engine.plan.calibrate import fit_host_update_gbps
from engine.plan.hardware import DEVICE_SPECS
from engine.plan.memory import memory_per_device
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.offload import host_memory, offload_time
from engine.plan.report import launch_command
from engine.plan.timing import estimate
from engine.tools import plan_cli
from engine.training.validate import memory_problem

# Llama-3-8B's shape: 32 x 4096, GQA 8 groups, SwiGLU 14336, vocabulary 128256, untied
L8B = ModelShape(32, 4096, 32, 128256, 2048, 256, ffn_hidden_size=14336, block="llama",
                 num_query_groups=8, fused_attention=True, dropout=False)
H, F, KV = 4096, 14336, 1024
N8B = 32 * (2 * H * H + 2 * H * KV + 3 * H * F + 2 * H) + 2 * 128256 * H + H   # 8,030,261,248
H200 = Cluster.from_device(DEVICE_SPECS["h200"], 1)
SMALL = ModelShape(4, 256, 8, 1000, 128, 16)
N_SMALL = 4 * (12 * 256 * 256 + 13 * 256) + 1024 * 256 + 128 * 256 + 2 * 256


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offload_moves_the_optimizer_state_to_host_memory(fraction):
    """dp 2, ZeRO-1, bf16: the device keeps (1 - F) of the 12 bytes per shard element, the host
    holds F of them and the gradient copies (fp32 4 + the bf16 staging copy 2)."""
    lay = Layout(1, 1, 2, micro_batch_size=2, zero=True, offload=fraction)
    mem = memory_per_device(SMALL, lay)
    shard = N_SMALL / 2
    assert mem.optimizer == pytest.approx((1 - fraction) * 12 * shard, rel=1e-12)
    assert (mem.weights, mem.grads) == (2 * N_SMALL, 4 * N_SMALL)   # unchanged by the offload
    host = host_memory(SMALL, lay, N_SMALL, 0.0)
    assert (host.optimizer, host.grads) == (12 * fraction * shard, 6 * fraction * shard)
    fp32 = host_memory(replace(SMALL, weight_bytes=4), lay, N_SMALL, 0.0)   # no staging copy
    assert fp32.grads == 4 * fraction * shard and fp32.optimizer == host.optimizer


def test_copies_pipeline_with_the_host_update():
    """1e9 elements, bf16, at 55 GB/s: 72.7 ms of gradients down, 36.4 ms of weights up; the host
    update at 57.6 GB/s (76.8 x 0.75) of 86 bytes each, 1.493 s. Down waits whole without a
    window, one bucket (10 %) under a long one; up hides behind the update but for its last
    bucket."""
    down, up, update = 4e9 / 55e9, 2e9 / 55e9, 1e9 * 86 / (76.8e9 * 0.75)
    copies, host = offload_time(L8B, H200, Layout(1, 1, 1, zero=True, offload=1.0), 1e9, 0.0, 0.1)
    assert host == pytest.approx(update, rel=1e-12)
    assert copies.exposed == pytest.approx(down + 0.1 * up, rel=1e-12)
    assert copies.total == pytest.approx(down + up, rel=1e-12)
    long, _ = offload_time(L8B, H200, Layout(1, 1, 1, zero=True, offload=1.0), 1e9, 10.0, 0.1)
    assert long.exposed == pytest.approx(0.1 * down + 0.1 * up, rel=1e-12)


def test_one_h200_trains_8b_only_with_the_offload():
    """16 bytes per parameter without the optimizer state's 12 would still be 48 GB: what does
    not fit is the 12 (96 GB). The search finds nothing without the offload and proposes it; its
    host update is the 86 bytes per parameter at 57.6 GB/s, 12.0 s of the step."""
    assert plan.search(L8B, H200, plan.SearchSpace(offload=(0.0,))) == []
    best = plan.search(L8B, H200)[0]
    assert best.layout.offload == 1.0 and best.layout.zero and best.fits
    assert best.time.host_update == pytest.approx(N8B * 86 / (76.8e9 * 0.75), rel=1e-12)
    assert best.host.optimizer == 12 * N8B and best.memory.optimizer == 0
    assert best.time.optimizer == 0.0 and 0 < best.time.offload_copy < best.time.host_update


def test_the_start_memory_check_counts_only_the_device_part():
    """One 141 GB device: the run without offload is refused in one line, with it it starts."""
    flags = ["--mock-data", "--vocab-size", "128256", "--num-layers", "32", "--hidden-size", "4096",
             "--num-attention-heads", "32", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
             "--block", "llama", "--seq-length", "2048", "--micro-batch-size", "1",
             "--global-batch-size", "256", "--precision", "bf16", "--use-distributed-optimizer"]
    grid = parse_args(flags).parallel.grid(1)
    available = int(141 * 2 ** 30)
    problem = memory_problem(parse_args(flags), grid, 0, available, "on the device", "nccl")
    assert problem and "the optimizer state" in problem
    with_offload = parse_args(flags + ["--optimizer-cpu-offload"])
    assert memory_problem(with_offload, grid, 0, available, "on the device", "nccl") is None


def test_the_host_rate_is_calibrated_from_the_update_time():
    """A run whose update took the model's time at 40 GB/s gives back 40 GB/s."""
    lay = Layout(1, 1, 1, micro_batch_size=2, zero=True, offload=1.0)
    measured = replace(H200, host_update_gbps=40.0)
    est = estimate(L8B, measured, lay)
    fitted = fit_host_update_gbps(L8B, H200, lay, est.time.optimizer + est.time.host_update)
    assert fitted == pytest.approx(40.0, rel=1e-9)


PLAN = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--block", "llama",
        "--vocab-size", "128256", "--seq-length", "2048", "--global-batch-size", "256",
        "--device", "h200", "--devices", "1", "--layout", "1,1", "--micro-batch-size", "2",
        "--recompute", "none"]


def test_the_cli_prints_a_command_that_offloads(capsys):
    assert plan_cli.main(PLAN + ["--json", "--top", "1"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["offload"] == 1.0 and row["host_memory_terms"]["optimizer"] == 12 * N8B
    argv = shlex.split(row["command"])
    cfg = parse_args(argv[argv.index("engine.train") + 1:])
    assert cfg.optim.optimizer_cpu_offload and cfg.parallel.use_distributed_optimizer
    half = launch_command(L8B, Layout(1, 1, 8, zero=True, zero_stage=3, offload=0.5), 8)
    cfg = parse_args(shlex.split(half)[shlex.split(half).index("engine.train") + 1:])
    assert (cfg.parallel.zero_stage, cfg.optim.optimizer_offload_fraction) == (3, 0.5)


@pytest.mark.parametrize("extra, message", [
    (["--zero-stage", "4"], "--zero-stage expects a comma list of 1, 2 and 3"),
    (["--optimizer-offload-fraction", "0"], "--optimizer-offload-fraction must be in (0, 1]"),
    (["--optimizer-cpu-offload", "on", "--zero", "off"], "give --zero on"),
    (["--host-link-gbps", "-1"], "--host-link-gbps must be a positive number"),
    (["--optimizer-cpu-offload", "on", "--device", "h100-pcie"], "give --host-memory-gbps"),
])
def test_bad_offload_arguments_get_one_line(extra, message, capsys):
    assert plan_cli.main(PLAN + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
