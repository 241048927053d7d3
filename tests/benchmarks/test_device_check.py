"""benchmarks/device_check/, the accelerator check in one call, exercised on the CPU: "nothing to
check" without an accelerator; the plan and its deadlines; the whole plan end to end with a tiny
model (``--allow-cpu --tiny``), its JSON and markdown; a stage that overruns its deadline or fails is
reported in the table, not raised; the 1.3B recipe's size; the FP8 stage (bf16 against FP8 on the
CPU's torch._scaled_mm with tiny models in the whole plan; skipped with the chip table's line on
a chip without FP8) and the layers of its hidden-4096 model."""
from __future__ import annotations

import json
import types

import torch

from benchmarks.device_check import run as device_check
from benchmarks.device_check.launch import launcher
from benchmarks.device_check.plan import (MIN_STAGE_S, MODEL, RESERVE_S, TINY, Stage, StageResult,
                                          deadline_for, plan, train_argv)
from benchmarks.device_check.kernels import check_kernels
from benchmarks.device_check.report import report
from engine.config.cli import parse_args


def _args(**kw):
    base = dict(tiny=True, steps=3, warmup=1, micro_batch_size=2, global_batch_size=4, budget_s=300.0)
    return types.SimpleNamespace(**{**base, **kw})


def test_without_an_accelerator_there_is_nothing_to_check(capsys, monkeypatch):
    monkeypatch.setattr(device_check, "detect_device_type", lambda requested="auto": "cpu")
    assert device_check.main([]) == 0
    assert "no accelerator (CUDA or Ascend NPU) found: nothing to check" in capsys.readouterr().out


def test_kernel_comparison_runs_on_cpu():
    rows = check_kernels(torch.device("cpu"), torch.float32, seq=64)
    assert [r["op"].split(" ")[0] for r in rows] == ["attention"] * 3 + [
        "ring_block", "layer_norm", "rms_norm", "rope", "swiglu", "grouped_gemm", "fp8"]
    assert all(r["ok"] for r in rows), rows
    # the paths the cases took on these operands (fp32 on the CPU: ATen's CPU flash kernel for
    # the ring's blocks; torch._grouped_mm for fp32 on the CPU, the loop for fp16, which it refuses)
    assert rows[3]["path"] == "cpu-flash" and rows[8]["path"] == "torch"
    half = check_kernels(torch.device("cpu"), torch.float16, seq=64, fp8=False)
    assert half[8]["path"] == "loop", half[8]
    fp8 = rows[-1]   # the CPU's path: one rowwise FP8 GEMM per tile; e4m3's error is visible
    assert fp8["path"] == "per 128-wide tile" and 0.005 < fp8["forward"] <= fp8["tolerance"][0]
    assert check_kernels(torch.device("cpu"), torch.float32, 64, fp8=False)[-1]["op"] != fp8["op"]


def test_the_fp8_row_sees_a_scale_on_the_wrong_tile(monkeypatch):
    """The blockwise row's bound is e4m3's rounding: weight blocks quantized with their
    neighbours' scales (rolled) flush or saturate and miss it by far."""
    from benchmarks.device_check import kernels as dk
    from kernels import fp8_blockwise as bw
    real = bw.block_scales
    monkeypatch.setattr(bw, "block_scales", lambda w: real(w).roll(1, dims=1))
    row = dk.fp8_blockwise_row(torch.device("cpu"), 128)
    assert not row["ok"] and row["forward"] > 5 * dk.FP8_TOLERANCE, row


def test_one_kernel_raising_keeps_the_other_rows(monkeypatch, tmp_path):
    """A case that raises (a kernel with no image for the device) is its own failed row with the
    error's last line; the other cases, the chunked-GEMM table and the report still come."""
    from benchmarks.device_check import kernels as dk
    cases = dk.kernel_cases

    def with_a_broken_one(device, dtype, seq=512):
        got = cases(device, dtype, seq)
        def boom(*a):
            raise RuntimeError("CUDA error:\nno kernel image is available for execution on the device")
        return [("broken", boom, *got[0][2:])] + got[1:]
    monkeypatch.setattr(dk, "kernel_cases", with_a_broken_one)
    rows = dk.check_kernels(torch.device("cpu"), torch.float32, 64)
    assert [r["op"] for r in rows][:2] == ["broken", "attention GQA (8 q / 2 kv heads)"] and len(rows) == 10
    assert rows[0]["ok"] is False and rows[0]["forward"] is None
    assert rows[0]["error"] == "RuntimeError: no kernel image is available for execution on the device"
    assert all(r["ok"] for r in rows[1:])
    args = types.SimpleNamespace(device="cpu", tiny=True, out=str(tmp_path))
    assert device_check._kernels_stage(args) == 0   # every case is a row: the stage's process ends
    assert len(json.loads((tmp_path / "gemm_chunks.json").read_text())) == 3
    md = report([StageResult("kernels", "failed", 90.0, 1.0, "outside tolerance or raised: broken",
                             kernels=rows)], {"device": "cpu", "device_name": "cpu", "torch": "x",
                                              "python": "3", "budget_s": 1.0, "wall_s": 1.0})
    assert "| broken | - | - | - | NO (RuntimeError: no kernel image is available" in md


def test_the_json_is_written_when_the_markdown_fails(tmp_path, monkeypatch):
    def broken(results, header):
        raise ValueError("Unknown format code 'f' for object of type 'str'")
    monkeypatch.setattr(device_check, "report", broken)
    text = device_check.write_report(tmp_path, {"device": "cpu"}, [StageResult("eager", "ok", 1.0, 1.0)], 0.0)
    assert [s["name"] for s in json.loads((tmp_path / "device_check.json").read_text())["stages"]] == ["eager"]
    assert text.startswith("device_check: the markdown report failed (ValueError: ")
    assert (tmp_path / "device_check.md").read_text() == text + "\n"


def test_plan_and_deadlines():
    assert [s.name for s in plan()] == ["kernels", "eager", "moe", "moe_dense", "fp8", "two_ranks",
                                        "syncs", "llama", "compiled", "tp_overlap", "zero",
                                        "packed", "offload"]
    assert [s.name for s in plan(skip_compile=True)] == ["kernels", "eager", "moe", "moe_dense",
                                                        "fp8", "two_ranks", "syncs", "llama",
                                                        "tp_overlap", "zero", "packed", "offload"]
    assert all(s.optional for s in plan() if s.name == "fp8")
    stage = Stage("eager", 180.0)
    assert deadline_for(stage, 1000.0) == 180.0                      # its own cap
    assert deadline_for(stage, 100.0) == 100.0 - RESERVE_S           # what the budget leaves
    assert deadline_for(stage, RESERVE_S + MIN_STAGE_S - 1) is None  # too little: skipped


def test_no_budget_skips_every_stage_without_running_one(tmp_path):
    args = _args(budget_s=RESERVE_S + MIN_STAGE_S - 1)
    results = device_check.run_plan(plan(), tmp_path, "cpu", args)
    assert [(r.name, r.status) for r in results] == [(s.name, "skipped") for s in plan()]
    assert list(tmp_path.iterdir()) == []


def test_whole_plan_on_cpu_writes_json_and_markdown(tmp_path, capsys):
    code = device_check.main(["--allow-cpu", "--tiny", "--skip-compile", "--out", str(tmp_path),
                              "--steps", "3", "--warmup", "1", "--micro-batch-size", "2",
                              "--global-batch-size", "4"])
    assert code == 0, capsys.readouterr().out
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert [(s["name"], s["status"]) for s in data["stages"]] == [
        ("kernels", "ok"), ("eager", "ok"), ("moe", "ok"), ("moe_dense", "ok"), ("fp8", "ok"),
        ("two_ranks", "skipped"), ("syncs", "ok"), ("llama", "ok"), ("tp_overlap", "ok"),
        ("zero", "ok"), ("packed", "ok"), ("offload", "ok")]
    kernels = data["stages"][0]["kernels"]
    assert len(kernels) == 10 and all(k["ok"] for k in kernels)   # the FP8 blockwise row last
    # the host waits per step of the MoE models at ep 1 and the dense one: the dense count
    syncs = {r["model"]: r["dispatch mode"] for r in data["stages"][6]["syncs"]}
    assert syncs == {name: [1, 1, 1] for name in ("moe ep1 dropless", "moe ep1 padded capacity",
                                                  "dense")}
    # the TP overlap's chunked GEMM against the plain one: the same values, timed
    gemm = data["stages"][0]["gemm_chunks"]
    assert [g["tp"] for g in gemm] == [2, 4, 8]
    assert all(g["max_err"] < 1e-5 and g["plain_ms"] > 0 and g["chunked_ms"] > 0 for g in gemm)
    # tp=2 with SP without and with --tp-comm-overlap, two gloo processes here
    pair = data["stages"][8]["tp_overlap"]
    assert [r["run"] for r in pair["rows"]] == ["plain", "overlap"]
    assert all(r["steps"] == 2 and r["tokens_per_s"] > 0 and r["time_tp_exposed_s"] > 0
               for r in pair["rows"]), pair
    assert pair["ratio"] == pair["rows"][1]["tokens_per_s"] / pair["rows"][0]["tokens_per_s"]
    # the two runs train one model: fp32 losses per step agree (the ring sums in another order)
    assert len(pair["rows"][0]["losses"]) == 3 and pair["loss_rel_diff"] <= 1e-4, pair
    for stage in data["stages"][1:]:
        if stage["name"] in ("tp_overlap", "two_ranks", "syncs", "fp8"):
            continue
        s = stage["summary"]
        if stage["name"] == "offload":   # its own warm-up of one step
            assert s["steps"] == 2 and stage["offload"]["host_update_share"] > 0, stage
            continue
        assert s["steps"] == 2 and s["tokens"] == 2 * 4 * 64 and s["tokens_per_s"] > 0
        assert s["mfu"] is not None and s["peak_memory_bytes"] > 0
        assert s["host_syncs_per_step"] == 1  # the step's one statistics read, MoE at ep 1 too
    # bf16 against FP8 (torch._scaled_mm on the CPU), the tiny pair on the repository's docs:
    # the same steps, both timed, mean losses close but not equal (the FP8 GEMMs ran)
    fp8 = data["stages"][4]["fp8"]
    assert fp8["steps"] == 3 and list(fp8["rows"]) == ["gpt 1.3b"]
    row = fp8["rows"]["gpt 1.3b"]
    assert row["bf16_tokens_per_s"] > 0 and row["fp8_tokens_per_s"] > 0, row
    assert row["ratio"] == row["fp8_tokens_per_s"] / row["bf16_tokens_per_s"]
    assert 0 < abs(row["loss_gap"]) < 0.01 and row["loss_met"] is True, row
    md = (tmp_path / "device_check.md").read_text()
    assert "| gpt 1.3b | 1 x 32, 2 heads, seq 32 |" in md and "| >= 1.1x: " in md
    assert "| eager | ok |" in md and "| packed | ok |" in md and "tokens/s" in md
    assert data["host_memory_available"] > 0 and "GiB; budget 540 s" in md.splitlines()[0]
    assert "MoE / dense (same active FLOPs) tokens/s" in md and "host waits: dispatch mode" in md
    assert "| moe | calibrated: " in md  # the planner fitted to this run's two metrics files
    assert "llama / gpt2 blocks (1.3B, eager) MFU" in md and "optimizer offload, over the steps" in md
    assert "chunked GEMMs (ms)" in md and "| overlap |" in md and "overlap / plain tokens/s" in md
    assert md.strip() in capsys.readouterr().out


def test_overrun_and_failure_are_reported_not_raised(tmp_path):
    args = _args(steps=100_000)  # far more than 1 s of steps on any machine
    late = device_check.run_stage(Stage("eager", 1.0), 1.0, tmp_path, "cpu", args)
    assert late.status == "deadline" and late.wall_s < 30
    assert late.detail.startswith("stopped at its 1 s deadline after ")
    bad = device_check.run_stage(Stage("eager", 60.0, flags=("--num-layers", "0")), 60.0, tmp_path,
                                 "cpu", _args())
    assert bad.status == "failed" and bad.detail.startswith("exit 2: gridtron: configuration error:")
    assert "num-layers" in bad.detail or "num_layers" in bad.detail


def test_tp_overlap_stage_is_skipped_with_one_device(tmp_path, monkeypatch):
    import benchmarks.device_check.tp_overlap as pair
    monkeypatch.setattr(pair, "device_count", lambda kind: 1)
    got = device_check.run_stage(Stage("tp_overlap", 60.0, optional=True), 60.0, tmp_path, "cuda", _args())
    assert got.status == "skipped" and got.detail.startswith("one cuda device: no pair")
    assert list(tmp_path.iterdir()) == []  # nothing was launched


def test_training_recipe_is_the_13b_gpt():
    from models import GPTChunk, LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    cfg = parse_args(train_argv("cuda", 20, "m.jsonl", "runs/x", ("--compile",)))
    assert cfg.compile and cfg.precision.precision == "bf16" and cfg.device == "cuda"
    assert not cfg.checkpoint.save and not cfg.log.plot  # no 16 GB save, no matplotlib needed
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (24, 2048, 16, 2048)
    with torch.device("meta"):
        model = GPTChunk(m, ParallelState.serial("meta"), LayerContext(Initializer(1, 0.02)),
                         range(m.num_layers))
    params = sum(p.numel() for p in model.parameters())
    assert 1.25e9 < params < 1.45e9, params


def test_a_stage_that_raises_is_its_failed_row_and_the_report_follows_each_stage(tmp_path,
                                                                                 monkeypatch):
    """An exception in the check's own process (the two-ranks probe once ran there) fails its
    stage only: the stages after it run, and the report is rewritten after every stage."""
    def stage_runner(stage, deadline_s, out, kind, args):
        if stage.name == "moe":
            raise RuntimeError("gloo:\nConnection closed by peer")
        return StageResult(stage.name, "ok", deadline_s, 1.0)
    monkeypatch.setattr(device_check, "run_stage", stage_runner)
    seen = []
    results = device_check.run_plan(plan()[:4], tmp_path, "cpu", _args(),
                                    on_result=lambda done: seen.append([r.status for r in done]))
    assert [(r.name, r.status) for r in results] == [("kernels", "ok"), ("eager", "ok"),
                                                     ("moe", "failed"), ("moe_dense", "ok")]
    assert results[2].detail == "RuntimeError in the check itself: Connection closed by peer"
    assert seen == [["ok"], ["ok", "ok"], ["ok", "ok", "failed"], ["ok", "ok", "failed", "ok"]]


def test_the_two_ranks_probe_is_a_command_under_its_deadline(tmp_path):
    """gloo with device tensors may crash or hang a probe process: the probe runs as one command
    under its deadline, and the ops it did not report are named as not probed."""
    from benchmarks.device_check.two_ranks import OPS, probe
    found, wall = probe("cpu", launcher("cpu"), tmp_path, 0.2)   # too short to start two ranks
    assert found == {op: "not probed: the probe stopped at its 0.2 s deadline" for op in OPS}
    assert wall < 30


def test_two_ranks_stage_probes_then_trains_against_serial(tmp_path):
    """The stage's body on the CPU (two gloo processes, CPU tensors): the probe finds every
    collective, the dp 2 ZeRO layout with the overlapped gather trains the serial model; a
    layout needing a collective the probe refused is reported with gloo's line, not run."""
    from benchmarks.device_check.two_ranks import LAYOUTS, probe, run_two_ranks
    found, wall = probe("cpu", launcher("cpu"), tmp_path, 60.0)
    assert found == {op: None for op in ("all_reduce", "all_gather", "reduce_scatter",
                                         "all_to_all", "broadcast", "p2p")} and wall > 0

    def argv_for(metrics, flags):
        return train_argv("cpu", 3, metrics, str(tmp_path / "run"), flags, 2, 8,
                                       TINY, "fp32")
    got = run_two_ranks(120.0, tmp_path, "cpu", argv_for, launcher("cpu"),
                        layouts={k: LAYOUTS[k] for k in ("dp2 zero", "pp2")},
                        refused=dict(found, p2p="Tensors must be CPU and dense"))
    assert got["status"] == "ok", got
    dp, pp = got["rows"]
    assert dp["layout"] == "dp2 zero" and dp["status"] == "ok" and dp["loss_rel_diff"] <= 1e-4, dp
    assert pp == {"layout": "pp2", "status": "refused", "loss_rel_diff": None,
                  "note": "gloo refuses p2p of cpu tensors: Tensors must be CPU and dense"}


def test_ep2_is_compared_with_a_serial_run_of_the_same_moe_model(tmp_path):
    """ep 2 trains 4 experts (top-2): its serial reference is the MoE model's own serial run, not
    the dense one (the two differ by about 4e-4 in the losses; ep 2 and its serial run by 1e-7)."""
    from benchmarks.device_check.two_ranks import LAYOUTS, MOE, OPS, run_two_ranks
    assert LAYOUTS["ep2"][0] == MOE and all(not LAYOUTS[k][0] for k in ("dp2 zero", "tp2 sp", "pp2"))

    def argv_for(metrics, flags):
        return train_argv("cpu", 3, metrics, str(tmp_path / "run"), flags, 2, 8, TINY, "fp32")
    got = run_two_ranks(200.0, tmp_path, "cpu", argv_for, launcher("cpu"),
                        layouts={"ep2": LAYOUTS["ep2"]}, refused={op: None for op in OPS})
    assert got["status"] == "ok" and got["rows"][0]["loss_rel_diff"] <= 1e-4, got
    assert (tmp_path / "two_ranks_serial_num-experts_4_moe-router-topk_2.jsonl").exists()


def test_a_probe_that_did_not_finish_is_not_an_ok_stage(tmp_path):
    """Ops the probe never reached (it crashed or was stopped) are not gloo refusing them: the
    layouts needing them are unchecked, and the stage says so."""
    from benchmarks.device_check.two_ranks import OPS, run_two_ranks
    crashed = {op: "not probed: the probe ended (exit 1: ImportError: x)" for op in OPS}
    got = run_two_ranks(60.0, tmp_path, "cuda", None, None, refused=crashed)
    assert got["status"] == "failed" and {r["status"] for r in got["rows"]} == {"failed"}, got
    assert got["rows"][0]["note"] == "all_reduce not probed: the probe ended (exit 1: ImportError: x)"
    stopped = {op: "not probed: the probe stopped at its 20 s deadline" for op in OPS}
    got = run_two_ranks(60.0, tmp_path, "cuda", None, None, refused=stopped)
    assert got["status"] == "deadline" and {r["status"] for r in got["rows"]} == {"deadline"}, got
    refused = {op: "Tensors must be CPU and dense" for op in OPS}
    got = run_two_ranks(60.0, tmp_path, "cuda", None, None, refused=refused)
    assert got["status"] == "ok" and got["detail"] == "gloo runs no layout's collectives on this device"
    assert {r["status"] for r in got["rows"]} == {"refused"}


def test_fp8_stage_is_skipped_on_a_chip_without_fp8(tmp_path, monkeypatch):
    from engine.device import runtime
    a100 = runtime.DeviceInfo("cuda", torch.device("cpu"), "nccl", "NVIDIA A100-SXM4-80GB",
                              capability=(8, 0))
    monkeypatch.setattr(runtime, "setup_device", lambda *a, **k: a100)
    got = device_check.run_stage(Stage("fp8", 60.0, optional=True), 60.0, tmp_path, "cuda", _args())
    assert got.status == "skipped" and got.fp8 is None
    assert got.detail.startswith("--fp8-format needs FP8 tensor cores (compute capability 8.9 or "
                                 "later: H100, H200, Ada, Blackwell), and NVIDIA A100-SXM4-80GB"), got
    assert list(tmp_path.iterdir()) == []  # nothing was launched


def test_fp8_wide_model_fills_the_device():
    """Hand figure for an H100 (80 GiB, 90% usable = 77 GB): a hidden-4096 layer holds 201M weights
    at 18 bytes (bf16 weight, fp32 gradient, fp32 master and Adam) = 3.6 GB and keeps about 34 s b h
    = 1.1 GB of activations at micro-batch 4: 4.8 GB; the embeddings and fp32 logits about 6 GB; so
    about 15 layers, above the cap of 12 (time). The free memory measured bounds it too: 30 GiB
    free, less the 6 GiB margin, hold about 4 layers."""
    from benchmarks.device_check.fp8 import WIDE_DEFAULT_LAYERS, WIDE_MAX_LAYERS, fp8_models, wide_layers
    assert WIDE_MAX_LAYERS == 12 and wide_layers("NVIDIA H100 80GB HBM3", 4, 16) == 12
    assert wide_layers("NVIDIA H100 80GB HBM3", 4, 16, free_bytes=79 * 2 ** 30) == 12
    assert 3 <= wide_layers("NVIDIA H100 80GB HBM3", 4, 16, free_bytes=30 * 2 ** 30) <= 5
    assert wide_layers("NVIDIA H100 80GB HBM3", 1, 16, free_bytes=30 * 2 ** 30) > \
        wide_layers("NVIDIA H100 80GB HBM3", 4, 16, free_bytes=30 * 2 ** 30)
    assert wide_layers("NVIDIA H200", 4, 16) == WIDE_MAX_LAYERS
    assert wide_layers("NVIDIA L40S", 4, 16) == WIDE_DEFAULT_LAYERS  # no memory figure in the table
    models = fp8_models(False, "NVIDIA H100 80GB HBM3", 4, 16)
    assert models["gpt 1.3b"] == MODEL
    assert models["gpt hidden 4096"] == {"num-layers": wide_layers("NVIDIA H100 80GB HBM3", 4, 16),
                                         "hidden-size": 4096, "num-attention-heads": 32,
                                         "seq-length": 2048, "vocab-size": 51200,
                                         "ffn-hidden-size": 16384}


def test_only_runs_the_named_stages_and_refuses_others(tmp_path, capsys):
    assert device_check.main(["--allow-cpu", "--tiny", "--out", str(tmp_path), "--only", "fp8,bogus"]) == 2
    assert "device_check: --only fp8,bogus: not stages of the plan (kernels, " in capsys.readouterr().err


def test_the_fp8_stage_runs_the_recipe_asked():
    """``--only fp8 --fp8-recipe blockwise``: the FP8 runs of both models take e4m3 blockwise
    flags the trainer accepts (tp 1: any width is whole tiles); the default pair stays hybrid
    tensorwise."""
    from benchmarks.device_check import fp8
    assert fp8.fp8_flags("tensorwise") == fp8.FP8_FLAGS == ("--fp8-format", "hybrid")
    args = device_check.build_parser().parse_args(["--only", "fp8", "--fp8-recipe", "blockwise"])
    assert device_check.build_parser().parse_args([]).fp8_recipe == "tensorwise"
    for model in fp8.fp8_models(False, "NVIDIA H100 80GB HBM3", 4, 16, None).values():
        cfg = parse_args(train_argv("cpu", 2, "m.jsonl", "run", fp8.fp8_flags(args.fp8_recipe), 4,
                                    16, model, "bf16"))
        assert (cfg.precision.fp8_format, cfg.precision.fp8_recipe) == ("e4m3", "blockwise")
