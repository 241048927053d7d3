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
from engine.plan.memory import memory_per_device, stage_param_split
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.offload import host_memory, offload_time
from engine.plan.report import launch_command
from engine.plan.timing import estimate
from engine.tools import plan_cli
from engine.training.memory_check import async_copy_bytes, memory_problem, planner_inputs, size_text

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


FLAGS_8B = ["--mock-data", "--vocab-size", "128256", "--num-layers", "32", "--hidden-size", "4096",
            "--num-attention-heads", "32", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
            "--block", "llama", "--seq-length", "2048", "--micro-batch-size", "4",
            "--global-batch-size", "256", "--precision", "bf16", "--use-distributed-optimizer",
            "--optimizer-cpu-offload"]
GIB = 2 ** 30


def test_the_host_part_is_checked_and_the_fractions_that_fit_are_named():
    """One 141 GB H200 on a node with 120 GiB of host memory free: all of the 8B's optimizer on
    the host (134.6 GiB with the gradients' copies) does not fit; the line names the fractions
    whose host part fits the host and whose device part fits the device, and so they do: the
    ends of the range pass, a step beyond either end is refused by that memory."""
    grid = parse_args(FLAGS_8B).parallel.grid(1)
    device, host = (int(141 * GIB), "free on cuda:0"), (120 * GIB, "host memory available")

    def check(fraction):
        cfg = parse_args(FLAGS_8B + ["--optimizer-offload-fraction", str(fraction)])
        return memory_problem(cfg, grid, 0, *device, "nccl", host)
    problem = check(1.0)
    assert problem.startswith("--optimizer-cpu-offload keeps about 135 GiB in host memory for rank 0 "
                              "(the offloaded optimizer state 89.7 GiB, the gradients' host copies "
                              "44.9 GiB"), problem
    assert "more than the 120 GiB host memory available" in problem
    # host: floor(20 x 120 / 134.6) / 20; device: 172.7 GiB without offload, 141 free, 89.8 movable
    assert "--optimizer-offload-fraction from 0.4 to 0.85 (both memories fit" in problem, problem
    assert check(0.4) is None and check(0.85) is None
    assert "host memory" in check(0.9) and check(0.35).startswith("this run needs about")
    # a device whose free memory is unknown: the host's bound alone
    unknown = memory_problem(parse_args(FLAGS_8B), grid, 0, None, "", "nccl", host)
    assert "choose an --optimizer-offload-fraction up to 0.85, or more data-parallel" in unknown
    # a device that holds the whole state: the offload is not needed
    roomy = memory_problem(parse_args(FLAGS_8B), grid, 0, 400 * GIB, "free", "nccl", host)
    assert roomy.endswith("up to 0.85, or no --optimizer-cpu-offload: the device holds the whole "
                          "state"), roomy
    # without a host figure (a dry run, an unreadable /proc/meminfo) only the device is checked
    assert memory_problem(parse_args(FLAGS_8B), grid, 0, *device, "nccl") is None
    # a host too small for any fraction the device allows: what else to change
    small = memory_problem(parse_args(FLAGS_8B), grid, 0, *device, "nccl", (40 * GIB, "host"))
    assert small.endswith("choose more data-parallel ranks (with the distributed optimizer each "
                          "holds 1/dp of the state) or a smaller model"), small


def test_an_async_save_counts_its_host_copy_of_everything_the_rank_saves():
    """--async-save copies what a rank saves into host buffers: the offloaded state again, and the
    device's weights and optimizer state (pinned): 14 bytes a parameter for the 8B in bf16 (the
    weights, the fp32 masters and both moments), 105 GiB at any offload fraction, on top of the
    offload's own host memory. On 120 GiB at fraction 0.85 that fits without it, no fraction fits
    with it, and the line says so; on 200 GiB it names the fractions that fit with the copy."""
    grid = parse_args(FLAGS_8B).parallel.grid(1)
    device, host = (int(141 * GIB), "free on cuda:0"), (120 * GIB, "host memory available")
    flags = FLAGS_8B + ["--optimizer-offload-fraction", "0.85"]
    assert memory_problem(parse_args(flags), grid, 0, *device, "nccl", host) is None
    saving = parse_args(flags + ["--save", "ckpt", "--async-save"])
    assert async_copy_bytes(saving, grid, 0, *planner_inputs(saving, grid), 0) == \
        pytest.approx(14 * N8B, rel=1e-12)
    problem = memory_problem(saving, grid, 0, *device, "nccl", host)
    assert problem.startswith("--optimizer-cpu-offload keeps about 219 GiB in host memory"), problem
    assert ", --async-save's host copy of what it saves 105 GiB:" in problem, problem
    assert problem.endswith("more than the 120 GiB host memory available; choose no --async-save "
                            "(each save then holds training while it is written), more "
                            "data-parallel ranks (with the distributed optimizer each holds 1/dp "
                            "of the state) or a smaller model"), problem
    roomy = memory_problem(saving, grid, 0, *device, "nccl", (200 * GIB, "host"))
    assert "choose an --optimizer-offload-fraction from 0.4 to 0.7 (both memories fit" in roomy
    # the host part at 0.7 with the copy: within 200 GiB, and at 0.75 not
    assert 14 * N8B + 0.7 * 18 * N8B <= 200 * GIB < 14 * N8B + 0.75 * 18 * N8B
    # without --save nothing is written: no copy (the flag is then only a note)
    assert memory_problem(parse_args(flags + ["--async-save"]), grid, 0, *device, "nccl",
                          host) is None


def test_an_async_save_without_offload_is_checked_against_the_host():
    """Without the offload the copy is the device's state: at dp=2 with the distributed optimizer
    rank 0 saves the weights and half the state (2 + 6 bytes a parameter), rank 1 its half alone
    (6); without the distributed optimizer rank 0 saves everything (14) and rank 1 nothing. On
    50 GiB of host memory per rank rank 0 is refused in one line and rank 1 is not."""
    flags = [f for f in FLAGS_8B if f != "--optimizer-cpu-offload"] + ["--save", "ckpt",
                                                                        "--async-save"]
    cfg = parse_args(flags)
    grid = cfg.parallel.grid(2)
    copies = [async_copy_bytes(cfg, grid, r, *planner_inputs(cfg, grid), 0) for r in (0, 1)]
    assert copies == [pytest.approx(8 * N8B, rel=1e-12), pytest.approx(6 * N8B, rel=1e-12)]
    plain = parse_args([f for f in flags if f != "--use-distributed-optimizer"])
    assert [async_copy_bytes(plain, grid, r, *planner_inputs(plain, grid), 0) for r in (0, 1)] == \
        [pytest.approx(14 * N8B, rel=1e-12), 0.0]
    host = (50 * GIB, "host memory available")
    problem = memory_problem(cfg, grid, 0, 400 * GIB, "free", "nccl", host)
    assert problem == ("--async-save keeps a host copy of what rank 0 saves, about 59.8 GiB (its "
                       "weights and optimizer state: engine/training/memory_check.py's estimate), "
                       "more than the 50 GiB host memory available; choose no --async-save (each "
                       "save then holds training while it is written), more ranks to split the "
                       "state (--tp, --pp; the distributed optimizer shards it over dp), or a "
                       "smaller model")
    assert memory_problem(cfg, grid, 1, 400 * GIB, "free", "nccl", host) is None


def test_on_the_cpu_the_offloaded_state_counts_in_the_one_memory():
    """Host and device are one memory: the offload frees nothing, so the offloaded state and the
    host copies add to the device's part against the one figure."""
    flags = [f for f in FLAGS_8B if f != "--optimizer-cpu-offload"]
    grid = parse_args(flags).parallel.grid(1)
    plain = parse_args(flags)
    offloaded = parse_args(flags + ["--optimizer-cpu-offload"])
    shape, layout = planner_inputs(offloaded, grid)
    device = memory_per_device(shape, layout).total
    host = host_memory(shape, layout, *stage_param_split(shape, layout, 0)).total
    need = memory_per_device(*planner_inputs(plain, grid)).total
    assert device + host > need  # the gradients' host copies come on top
    enough = int(device + host) + 1
    assert memory_problem(offloaded, grid, 0, enough, "host", "gloo", one_memory=True) is None
    problem = memory_problem(offloaded, grid, 0, int(device + host) - 1, "host", "gloo",
                             one_memory=True)
    assert problem and problem.startswith(f"this run needs about {size_text(device + host)}")
    assert "the largest part is the offloaded optimizer state" in problem
    assert problem.endswith("or none: on the CPU host memory is the device's, so the offload "
                            "frees nothing")
    # as the device check alone it would pass: the host part is what refuses it
    assert memory_problem(offloaded, grid, 0, int(device + host) - 1, "host", "gloo") is None


def test_validate_run_reads_the_host_figure_on_a_device(monkeypatch):
    """On a CUDA device validate_run checks the offloaded part against the host's MemAvailable
    (shared by the node's processes), and says so in one line before anything is allocated."""
    from engine.base import ConfigError
    from engine.training import validate
    from parallel.grid.launch import LaunchEnv
    asked = []

    def figures(kind, local_rank=0, local_world_size=1, backend=None):
        asked.append(kind)
        return (int(141 * GIB), "free on cuda:0") if kind == "cuda" else \
            (100 * GIB, "host memory available (MemAvailable)")
    monkeypatch.setattr(validate, "detect_device_type", lambda requested: "cuda")
    monkeypatch.setattr(validate, "available_memory", figures)
    with pytest.raises(ConfigError, match=r"^--optimizer-cpu-offload keeps about 135 GiB in host "
                                          r"memory .* more than the 100 GiB host memory available "
                                          r"\(MemAvailable\); choose an --optimizer-offload-fraction "
                                          r"from 0.4 to 0.7 "):
        validate.validate_run(parse_args(FLAGS_8B), LaunchEnv())
    assert asked == ["cuda", "cpu"]
    asked.clear()  # without the offload the host is not asked
    with pytest.raises(ConfigError, match="the optimizer state"):
        validate.validate_run(parse_args(FLAGS_8B[:-1]), LaunchEnv())
    assert asked == ["cuda"]
    asked.clear()  # ... unless --async-save copies what it saves there
    with pytest.raises(ConfigError, match="the optimizer state"):
        validate.validate_run(parse_args(FLAGS_8B[:-1] + ["--save", "ckpt", "--async-save"]),
                              LaunchEnv())
    assert asked == ["cuda", "cpu"]


def test_the_search_keeps_the_offload_within_the_hosts_memory():
    """A node with 120 GiB of host memory for one H200: the whole optimizer on the host (134.6 GiB
    with the gradients' copies) does not fit, so the search offloads the largest fraction that
    does, 0.85 (host 114.4 GiB), which the device can hold the rest of. With 10 GiB (at most
    0.05 offloaded) no layout fits the device; without the figure the whole state goes to the
    host."""
    host = replace(H200, host_memory_gb=120.0)
    best = plan.search(L8B, host)[0]
    assert best.layout.offload == 0.85 and best.fits
    assert best.host.total == pytest.approx(0.85 * 18 * N8B, rel=1e-12)  # 12 + 4 + 2 bytes each
    assert best.host.total <= 120 * GIB < 18 * N8B
    assert plan.search(L8B, replace(H200, host_memory_gb=10.0)) == []
    assert plan.search(L8B, H200)[0].layout.offload == 1.0
    with pytest.raises(ValueError, match="host_memory_gb must be > 0"):
        replace(H200, host_memory_gb=0.0)


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


def test_the_cli_plans_within_the_hosts_memory_and_the_run_passes_the_start_check(capsys):
    """``--host-memory-gb 120``: the printed command offloads 0.85, and that run passes the
    start's memory check on a device of the planner's usable memory and that host."""
    assert plan_cli.main(PLAN + ["--host-memory-gb", "120", "--json", "--top", "1"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["offload"] == 0.85 and row["host_memory_terms"]["total"] <= 120 * GIB
    argv = shlex.split(row["command"])
    cfg = parse_args(argv[argv.index("engine.train") + 1:] + ["--mock-data"])
    assert cfg.optim.optimizer_offload_fraction == 0.85
    assert memory_problem(cfg, cfg.parallel.grid(1), 0, int(H200.usable_bytes), "free", "nccl",
                          (120 * GIB, "host")) is None
    assert memory_problem(cfg, cfg.parallel.grid(1), 0, int(H200.usable_bytes), "free", "nccl",
                          (100 * GIB, "host")).startswith("--optimizer-cpu-offload keeps about")


@pytest.mark.parametrize("extra, message", [
    (["--host-memory-gb", "0"], "--host-memory-gb must be a positive number"),
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
