"""The pure parts of benchmarks/communication/scaling.py and benchmarks/peers/compare.py, and one
tiny real run of the PyTorch-native comparison: dp=2 for 2 steps, whose losses must match the
engine's."""
from __future__ import annotations

import math
import os

import pytest
import torch

from benchmarks.communication import scaling
from benchmarks.host import checkpoint
from benchmarks.peers import compare as peers
from benchmarks.common import (Layout, fmt_bytes, markdown_table, max_rel_diff, parse_int_list,
                               parse_layout, scaling_efficiency, steady, summarize)


def _records(times, tokens=1000, **extra):
    return [{"step": i + 1, "loss": 5.0, "step_time_s": t, "tokens": tokens, **extra}
            for i, t in enumerate(times)]


def test_layout_parsing_and_errors():
    assert parse_layout("2,1,4") == Layout(2, 1, 4)
    assert parse_layout("2x2x2").world == 8
    assert Layout(2, 2, 2).tag == "tp2-pp2-dp2" and str(Layout(1, 2, 1)) == "(1,2,1)"
    assert Layout(2, 1, 1).flags() == ["--tp", "2", "--pp", "1", "--dp", "1"]
    for bad in ("2,1", "a,1,1", "0,1,1"):
        with pytest.raises(ValueError):
            parse_layout(bad)
    assert parse_int_list("1,2,4,8", "--nprocs") == [1, 2, 4, 8]
    for bad in ("1,1", "0", "", "x"):
        with pytest.raises(ValueError):
            parse_int_list(bad, "--nprocs")


def test_default_and_planned_layouts():
    assert scaling.default_layouts(1) == [Layout(1, 1, 1)]
    assert scaling.default_layouts(2) == [Layout(1, 1, 2)]
    assert scaling.default_layouts(4) == [Layout(1, 1, 4), Layout(2, 1, 2), Layout(1, 2, 2)]
    assert scaling.default_layouts(8) == [Layout(1, 1, 8), Layout(2, 1, 4), Layout(1, 2, 4),
                                          Layout(2, 2, 2)]
    planned = scaling.plan_layouts([2, 4], None)
    assert planned[0] == Layout(1, 1, 1)  # the baseline is added and comes first
    assert [l.world for l in planned] == sorted(l.world for l in planned)
    assert planned[1:3] == [Layout(1, 1, 2), Layout(1, 1, 4)]  # dp-only first within a count
    explicit = scaling.plan_layouts([8], [Layout(2, 2, 2), Layout(2, 2, 2)])
    assert explicit == [Layout(1, 1, 1), Layout(2, 2, 2)]


def test_global_batch_per_mode():
    assert scaling.global_batch("strong", Layout(1, 1, 4), 16, 8) == 16
    assert scaling.global_batch("weak", Layout(2, 1, 4), 16, 8) == 32
    with pytest.raises(ValueError):
        scaling.global_batch("other", Layout(), 16, 8)


def test_efficiency_arithmetic():
    assert scaling_efficiency(300.0, 4, 100.0) == pytest.approx(0.75)
    assert scaling_efficiency(100.0, 1, 100.0) == 1.0
    with pytest.raises(ValueError):
        scaling_efficiency(1.0, 0, 1.0)
    rows = [{"layout": "(1,1,1)", "procs": 1, "status": "ok", "tokens_per_s": 100.0},
            {"layout": "(1,1,2)", "procs": 2, "status": "ok", "tokens_per_s": 150.0},
            {"layout": "(2,1,1)", "procs": 2, "status": "failed", "reason": "x"}]
    scaling.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.75, None]


def test_median_run_of_repeats():
    runs = [{"tokens_per_s": t, "mfu": t / 10} for t in (30.0, 10.0, 20.0, 40.0)]
    picked = scaling.median_run(runs)
    assert picked["tokens_per_s"] == 20.0 and picked["mfu"] == 2.0  # lower middle, whole summary
    assert picked["runs_tokens_per_s"] == [30.0, 10.0, 20.0, 40.0]
    assert scaling.median_run(runs[:1])["tokens_per_s"] == 30.0


def test_summary_drops_warmup_and_takes_totals_over_time():
    recs = _records([9.0, 9.0, 1.0, 2.0, 7.0], tokens=1000, dp_comm_bytes=10,
                    bubble_theoretical=None)
    for r, mfu in zip(recs, (0.1, 0.1, 0.8, 0.4, 0.2)):  # model FLOPs per step: mfu * time * peak
        r["mfu"], r["model_tflops_per_device"] = mfu, 2 * mfu
    s = summarize(recs, warmup=2)
    assert s["steps"] == 3 and s["warmup"] == 2 and s["step_time_s"] == pytest.approx(10 / 3)
    assert s["tokens_per_s"] == pytest.approx(3000 / 10)  # not the mean of 1000, 500 and 143
    # all model FLOPs over all seconds: (0.8*1 + 0.4*2 + 0.2*7) / 10, not the mean 0.467
    assert s["mfu"] == pytest.approx(0.3) and s["model_tflops_per_device"] == pytest.approx(0.6)
    assert s["hfu"] is None  # unknown in some step: unknown in total
    assert s["bubble_theoretical"] is None and s["dp_comm_bytes"] == 10
    assert len(steady(recs, 0)) == 5
    with pytest.raises(ValueError, match="raise --steps"):
        steady(recs, 5)


def test_tables_and_formatting():
    text = markdown_table(["a", "b"], [[1, "x"], [2, "y"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x |", "| 2 | y |"]
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [[1]])
    assert fmt_bytes(512) == "512 B" and fmt_bytes(3 * 1024 ** 2) == "3.0 MiB" and fmt_bytes(None) == "-"
    rows = [{"procs": 1, "layout": "(1,1,1)", "global_batch": 8, "status": "ok", "tokens_per_s": 1234.4,
             "tflops_per_device": 0.01, "mfu": 0.25, "bubble_theoretical": None,
             "bubble_measured": None, "dp_comm_bytes": 0, "dp_comm_wire_bytes": 0,
             "efficiency": 1.0},
            {"procs": 4, "layout": "(1,2,2)", "global_batch": 8, "status": "ok", "tokens_per_s": 2000.0,
             "tflops_per_device": 0.004, "mfu": None, "bubble_theoretical": 0.2,
             "bubble_measured": 0.45, "dp_comm_bytes": 2048, "dp_comm_wire_bytes": 3072,
             "efficiency": 0.4051},
            {"procs": 3, "layout": "(3,1,1)", "global_batch": 8, "status": "skipped",
             "reason": "heads"}]
    lines = scaling.table(rows).splitlines()
    assert lines[2].startswith("| 1 | (1,1,1) | 8 | 1234 | 0.0100 | 25.0% | - | 0 B | 0 B | 1.00 |")
    assert "| 0.20 / 0.45 | 2.0 KiB | 3.0 KiB | 0.41 |" in lines[3] and "| - |" in lines[3]
    assert "skipped: heads" in lines[4]


def test_max_rel_diff():
    assert max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert max_rel_diff([1.1, 2.0], [1.0, 2.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        max_rel_diff([1.0], [1.0, 2.0])


def test_peer_comparison_takes_medians_and_the_worst_loss_gap():
    eng = [_records([1.0, 0.5]), _records([1.0, 0.25])]
    nat = [_records([1.0, 1.0]), _records([1.0, 1.0])]
    nat[1][1]["loss"] = 5.0 * (1 + 3e-5)
    res = peers.compare(eng, nat, warmup=1)
    assert res["engine_runs_tokens_per_s"] == [2000.0, 4000.0]
    assert res["engine_tokens_per_s"] == 3000.0 and res["native_tokens_per_s"] == 1000.0
    assert res["ratio"] == 3.0 and res["max_rel_loss_diff"] == pytest.approx(3e-5)
    with pytest.raises(ValueError):
        peers.compare(eng, nat[:1], warmup=1)


def test_engine_verdict_before_launch():
    base = scaling.recipe_flags(None)
    ok = scaling.job_argv(base, Layout(2, 2, 2), 16, 4, "m.jsonl", 0.05)
    assert scaling.why_not(ok, 8) is None
    assert "--tp" in scaling.why_not(scaling.job_argv(base, Layout(3, 1, 1), 16, 4, "m", None), 3)
    assert "divisible" in scaling.why_not(scaling.job_argv(base, Layout(1, 1, 8), 12, 4, "m", None), 8)
    with pytest.raises(ValueError, match="heads"):
        peers.check_layout(Layout(3, 1, 1), peers.SPEC)
    with pytest.raises(ValueError, match="multiple"):
        peers.check_layout(Layout(1, 1, 8), peers.SPEC)


def test_native_model_matches_the_engine_serial_model():
    from benchmarks.peers.native import NativeGPT, copy_engine_weights, parse
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    args = parse(["--out", "unused", "--num-layers", "2", "--hidden-size", "32",
                  "--seq-length", "16", "--vocab-size", "200"])
    native = NativeGPT(200, 32, 4, 128, 16, range(2))
    copy_engine_weights(native, args)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=200, seed=args.seed)
    ref = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(args.seed, cfg.init_std)),
                   range(2))
    tokens = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    want = ref(x, y).mean()
    got = torch.nn.functional.cross_entropy(native(x).flatten(0, 1), y.flatten())
    assert math.isclose(got.item(), want.item(), rel_tol=1e-6)


def test_peers_end_to_end_dp2(tmp_path):
    """Both sides really launched (torchrun, 2 gloo ranks each) for 2 steps."""
    res = peers.run_layout(Layout(1, 1, 2), peers.SPEC, steps=2, warmup=1, out_dir=tmp_path,
                           timeout_s=120)
    assert len(res["engine_losses"]) == len(res["native_losses"]) == 2
    assert res["max_rel_loss_diff"] < 1e-5, (res["engine_losses"], res["native_losses"])
    assert res["engine_tokens_per_s"] > 0 and res["native_tokens_per_s"] > 0
    assert res["ratio"] == pytest.approx(res["engine_tokens_per_s"] / res["native_tokens_per_s"])
    report = peers.report([res], peers.SPEC, 2, 1, 1e-4)
    assert "| (1,1,2) | 1f1b | 2 |" in report and "| yes |" in report


def test_checkpoint_benchmark_sizes_and_tiny_run(tmp_path, capsys):
    assert checkpoint.parse_size("10MB") == 10**7 and checkpoint.parse_size("1.5gb") == 15 * 10**8
    with pytest.raises(ValueError):
        checkpoint.parse_size("10 MiB")
    for size in ("10MB", "100MB", "1GB"):  # the model picked holds about that much state
        hidden, layers = checkpoint.model_shape(checkpoint.parse_size(size))
        params = layers * (12 * hidden ** 2 + 13 * hidden) + (checkpoint.VOCAB + checkpoint.SEQ) * hidden
        assert 0.7 < params * checkpoint.BYTES_PER_PARAM / checkpoint.parse_size(size) < 1.3, size
    (row,) = checkpoint.main(["--sizes", "1MB", "--repeats", "1", "--dir", str(tmp_path)])
    assert row["identical"] and row["steps"] >= 1 and 0 < row["start_s"] <= row["async_s"]
    assert os.listdir(tmp_path) == []  # checkpoints removed
    assert "| files identical |" in capsys.readouterr().out


def test_long_context_counts_each_saved_tensor_once():
    """benchmarks/memory/long_context.py's accounting on one rank: the SwiGLU MLP of a layer saves its input,
    gate, up, silu(gate) and product, s (h + 4 f) fp32 values; parameters are not counted; the
    planner figure is the planner's layer term."""
    from benchmarks.memory import long_context as lc
    from parallel.grid.state import ParallelState
    seq, h = 64, lc.MODEL["hidden_size"]
    result = lc.measure(ParallelState.serial(), seq, "p2p", 1)
    f = lc.build(ParallelState.serial(), seq, "p2p").cfg.ffn_hidden_size
    assert result["bytes"]["mlp"] == lc.MODEL["num_layers"] * 4 * seq * (h + 4 * f)
    assert result["bytes"]["attention"] > 0 and result["bytes"]["norm"] > 0
    assert lc.planner_bytes(seq, 2) == lc.planner_bytes(seq, 1) / 2
    table = lc.table({1: {seq: result}}, [seq])
    assert table.splitlines()[2].startswith(f"| {seq} | 1 |")

def test_resilience_benchmark_tiny_run(capsys):
    from benchmarks.host import resilience
    row = resilience.main(["--steps", "5", "--fault-step", "4", "--hidden", "32", "--layers", "1"])
    assert row["faulty_losses_equal_plain"] and row["reruns"] == 1, row
    assert "fastest step: plain" in capsys.readouterr().out


def test_moe_benchmark_skips_a_refused_dispatcher_and_tabulates():
    """benchmarks/convergence/moe.py's pure parts: the engine's own parser decides what is skipped; the tables
    carry the skipped reason, the imbalance and the validation losses."""
    from benchmarks.convergence import moe
    base = [*moe.MODEL, *moe.MOE, "--mock-data", "--vocab-size=512", "--dp=4", "--ep=2"]
    assert moe.refused(base + ["--moe-token-dispatcher-type=alltoall"]) is None
    assert "flex" in moe.refused(base + ["--moe-token-dispatcher-type=flex"])
    tput = [{"dispatcher": "alltoall", "ep": 2, "tokens_per_s": 1234.4, "ep_comm_bytes": 4 * 2 ** 20},
            {"dispatcher": "allgather", "ep": 2, "skipped": "not built"}]
    runs = {"MoE, aux loss": {"imbalance": [1.5, 1.25, 1.0], "valid": [(2, 8.5), (4, 8.0)],
                              "loss": [9.0, 8.0, 7.0]},
            "dense": {"imbalance": [None] * 3, "valid": [(2, 8.4)], "loss": [9.0, 8.0, 6.0]}}
    text = moe.tables(tput, runs, window=2)
    assert "| alltoall | 2 | 1234 | 4.0 MiB |" in text and "skipped: not built" in text
    assert "| MoE, aux loss | 1.50 | 1.50 | 1.125 | 8.500 | 8.000 | 7.500 |" in text
    assert "| dense | - | - | - | 8.400 | 8.400 | 7.000 |" in text


def test_zero3_benchmark_pairs_totals_and_tiny_run(capsys):
    """benchmarks/memory/zero3.py: the pairs alternate which strategy runs first; the ratio is total
    seconds over total steps (a mean of the jobs' rates would give 2.5 / 1.5 here, not 2.25 /
    1.5); one tiny pair through the trainer: the same losses, half the parameter bytes per rank
    and more DP bytes under ZeRO-3."""
    from benchmarks.memory import zero3
    assert zero3.order(3) == ["ZeRO-2", "ZeRO-3", "ZeRO-3", "ZeRO-2", "ZeRO-2", "ZeRO-3"]
    runs = [{"strategy": "ZeRO-2", "seconds": 3.0, "steps": 2},
            {"strategy": "ZeRO-2", "seconds": 3.0, "steps": 2},
            {"strategy": "ZeRO-3", "seconds": 6.0, "steps": 3},
            {"strategy": "ZeRO-3", "seconds": 3.0, "steps": 1}]
    assert zero3.ratio(runs, "ZeRO-3", "ZeRO-2") == pytest.approx(2.25 / 1.5)
    assert zero3.pair_ratios(runs[:1] + runs[2:3] + runs[1:2] + runs[3:]) == pytest.approx([2 / 1.5, 3 / 1.5])
    runs = zero3.main(["--steps", "3", "--pairs", "1", "--num-layers", "1", "--hidden-size", "32",
                       "--seq-length", "16", "--micro-batch-size", "2"])
    two, three = ({r["strategy"]: r for r in runs}[s] for s in ("ZeRO-2", "ZeRO-3"))
    assert three["losses"] == pytest.approx(two["losses"], rel=1e-6)   # fp32 rounding at most
    assert three["memory"]["param_bytes"] * 2 == two["memory"]["param_bytes"]
    assert three["dp_bytes"] > two["dp_bytes"] and three["gathered_peak"] > 0 == two["gathered_peak"]
    assert "step time ZeRO-3 / ZeRO-2:" in capsys.readouterr().out
