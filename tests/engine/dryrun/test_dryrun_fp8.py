"""FP8 in the dry run against the planner: what ``--fp8-format`` adds to a step's TP, CP and DP
bytes (the MAX all-reduces that agree on every scale over the logical tensor,
parallel/tensor_parallel/fp8.py) is, to the byte, the planner's ``amax_bytes`` of the rank's FP8
layers (engine/plan/fp8.py, traffic.stage_amax_bytes) times the micro-batches: the same dry run
with and without FP8, differenced, so that what the planner leaves out elsewhere (the
sequence-parallel norms' gradient sum) cancels. Sequence parallelism and its ring
(--tp-comm-overlap), full recomputation, rowwise scales, context parallelism, an MoE layer's shared
expert, its experts' grouped GEMMs (amaxes over ETP, over TP under sequence parallelism without
ETP, over CP at ep 1, over EDP per micro-batch under EP with CP, in the DP bytes; the alltoall
dispatcher: the dry run's assumed routing gives the allgather dispatcher's experts more than the
balanced T K rows, engine/dryrun/assumed.py) and the bf16 first and last layers."""
from __future__ import annotations

import pytest

from engine.config.cli import parse_args
from engine.dryrun import dry_run
from engine.plan.model import num_micro_batches
from engine.plan.traffic import stage_amax_bytes
from engine.training.memory_check import planner_inputs

BASE = ["--mock-data", "--vocab-size", "500", "--num-layers", "2", "--hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--no-progress", "--precision", "bf16"]
CASES = {   # name: (world, flags); every case has tp 2 and/or cp 2
    "SP ring, full recompute, rowwise": (
        2, "--tp 2 --sequence-parallel --tp-comm-overlap --recompute full --fp8-recipe rowwise"),
    "SP, full recompute, tensorwise": (2, "--tp 2 --sequence-parallel --recompute full"),
    "llama GQA tp2 cp2 SP rowwise": (
        4, "--tp 2 --cp 2 --sequence-parallel --block llama --num-query-groups 2 "
           "--fp8-recipe rowwise"),
    "MoE with a shared expert, SP": (
        2, "--tp 2 --sequence-parallel --num-experts 4 --moe-router-topk 2 "
           "--moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 256"),
    "MoE ep2 etp2 SP, full recompute": (
        4, "--tp 2 --dp 2 --ep 2 --etp 2 --sequence-parallel --recompute full --num-experts 4 "
           "--moe-router-topk 2 --moe-ffn-hidden-size 128"),
    "MoE llama ep2 etp2": (
        4, "--tp 2 --dp 2 --ep 2 --etp 2 --block llama --num-experts 4 --moe-router-topk 2 "
           "--moe-ffn-hidden-size 64"),
    "MoE llama cp2 ep1, rowwise": (
        2, "--cp 2 --block llama --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
           "--fp8-recipe rowwise"),
    "MoE llama dp2 cp2 ep2, rowwise": (
        4, "--dp 2 --cp 2 --ep 2 --block llama --num-experts 4 --moe-router-topk 2 "
           "--moe-ffn-hidden-size 64 --fp8-recipe rowwise --global-batch-size 8"),
    "llama pp2, bf16 first and last layer": (
        4, "--tp 2 --pp 2 --num-layers 4 --block llama --first-last-layers-bf16 "
           "--recompute full"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_adds_the_planners_amax_bytes(name):
    world, flags = CASES[name]
    plain = dry_run(parse_args(BASE + flags.split()), world)
    fp8 = dry_run(parse_args(BASE + flags.split() + ["--fp8-format", "hybrid"]), world)
    shape, layout = planner_inputs(fp8.cfg, fp8.grid)
    m = num_micro_batches(shape, layout)
    added = []
    for bf16, run in zip(plain.records, fp8.records):
        want = tuple(m * b for b in stage_amax_bytes(shape, layout, run.stage))
        got = tuple(run.metrics[f"{k}_comm_bytes"] - bf16.metrics[f"{k}_comm_bytes"]
                    for k in ("tp", "cp", "dp"))
        assert got == want, (name, run.role.name, got, want)
        added.append(sum(got))
    assert min(added) > 0   # every rank reduces scales (the pp case: each stage has FP8 layers)


BLOCKWISE = {   # name: (world, flags): widths in 128s per TP rank, 128-token CP chunks
    "tp2 cp2 SP ring": (4, "--tp 2 --cp 2 --sequence-parallel --tp-comm-overlap --seq-length 512"),
    "MoE llama tp2 SP, a shared expert": (
        2, "--tp 2 --sequence-parallel --block llama --ffn-hidden-size 512 --num-experts 4 "
           "--moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 256"),
}


@pytest.mark.parametrize("name", list(BLOCKWISE))
def test_blockwise_adds_no_bytes_for_the_linears(name):
    """--fp8-recipe blockwise reduces no scale of the tensor-parallel linears (each tile's own):
    against bf16 the dry run adds what the planner says, nothing for a dense model and the
    experts' rowwise amaxes (e4m3) for an MoE layer."""
    world, flags = BLOCKWISE[name]
    argv = BASE + ["--hidden-size", "256"] + flags.split()
    plain = dry_run(parse_args(argv), world)
    fp8 = dry_run(parse_args(argv + ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]), world)
    shape, layout = planner_inputs(fp8.cfg, fp8.grid)
    m = num_micro_batches(shape, layout)
    for bf16, run in zip(plain.records, fp8.records):
        want = tuple(m * b for b in stage_amax_bytes(shape, layout, run.stage))
        got = tuple(run.metrics[f"{k}_comm_bytes"] - bf16.metrics[f"{k}_comm_bytes"]
                    for k in ("tp", "cp", "dp"))
        assert got == want, (name, run.role.name, got, want)
        assert (sum(got) > 0) == ("MoE" in name), (name, got)


R03 = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--vocab-size", "256", "--mock-data", "--global-batch-size", "16", "--micro-batch-size", "1",
       "--world-size", "8", "--tp", "2", "--bf16", "--fp8-format", "e4m3"]


def test_a_device_without_fp8_is_refused_with_the_planners_line(capsys):
    """``--device a100-80gb --fp8-format e4m3`` is refused as the planner refuses it (its check,
    engine/plan/hardware.py ``fp8_peak_problem``), with what to change in a dry run; on an FP8
    chip the precision line says the GEMMs' format."""
    from engine.base import ConfigError
    from engine.dryrun.cli import main
    from engine.tools import plan_cli
    assert main(R03 + ["--device", "a100-80gb"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert plan_cli.main(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                          "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "16",
                          "--devices", "8", "--device", "a100-80gb", "--fp8-format", "e4m3"]) == 2
    planner = capsys.readouterr().err.removeprefix("gridtron: ").split("; give ")[0]
    assert planner.startswith("--fp8-format: a100-80gb has no FP8 peak")
    assert captured.err.splitlines() == [
        f"gridtron: configuration error: {planner}; drop --fp8-format, or choose a --device with "
        f"FP8 (h100, h200)"], captured.err
    cfg = parse_args([t for t in R03 if t not in ("--world-size", "8")])
    with pytest.raises(ConfigError, match=r"^--fp8-format: a100-80gb has no FP8 peak"):
        dry_run(cfg, 8, "a100-80gb")
    assert main(R03 + ["--device", "h100"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "precision: bf16 (--precision); FP8 GEMMs: --fp8-format e4m3 --fp8-recipe tensorwise")
