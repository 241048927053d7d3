"""Stages of the device check (benchmarks/device_check/) on the CPU: the FP8 pairs train on real
text, so their loss target can be missed; the optimizer-offload stage's command line passes the
engine's checks for one H200 and its host; a stage that did not finish is not read against a
target."""
from __future__ import annotations

import json
import types

import pytest

from benchmarks.device_check.plan import Stage, StageResult, deadline_for, plan

GIB = 2 ** 30


def _args(**kw):
    base = dict(tiny=True, steps=6, warmup=1, micro_batch_size=2, global_batch_size=4, budget_s=300.0)
    return types.SimpleNamespace(**{**base, **kw})


def test_fp8_loss_target_is_missed_by_a_run_that_does_not_train(tmp_path, monkeypatch):
    """The pairs train on the repository's docs (byte ids, in the models' own vocabulary): an FP8
    run whose learning rate vanishes stays near ln V while bf16's loss falls, and the loss target
    says so (on uniform random tokens both would sit at ln V and the target would be met)."""
    from benchmarks.device_check import fp8
    monkeypatch.setattr(fp8, "FP8_FLAGS", fp8.FP8_FLAGS + ("--lr", "1e-12", "--min-lr", "0"))
    got = fp8.fp8_stage(Stage("fp8", 260.0, optional=True, steps=10), 200.0, tmp_path, "cpu", _args())
    assert got.status == "ok", got
    row = got.fp8["rows"]["gpt 1.3b"]
    assert row["loss_met"] is False and row["loss_gap"] > 0.02, row
    assert (tmp_path / "fp8_data" / "text.bin").exists()
    assert "vocabulary 512" in (tmp_path / "fp8_gpt_13b_bf16.log").read_text()   # the model's
    assert "| gpt 1.3b | 1 x 32, 2 heads, seq 32 |" in "\n".join(fp8.fp8_lines([got]))
    assert "within 1%: missed" in "\n".join(fp8.fp8_lines([got]))


def test_offload_command_passes_the_engines_checks_on_an_h200(monkeypatch):
    """The 8B with its optimizer offloaded at the fraction the stage computes for 141 GiB free on
    the device and 120 GiB on the host: parse_args and validate_run (the memory check at start
    included) accept it; all of the optimizer on the host would not fit."""
    from engine.base import ConfigError
    from engine.config.cli import parse_args
    from engine.training import validate
    from benchmarks.device_check.offload import offload_argv, offload_fraction
    from parallel.grid.launch import LaunchEnv
    monkeypatch.setattr(validate, "detect_device_type", lambda requested: "cuda")
    device, host = (int(141 * GIB), "test"), (120 * GIB, "test")
    fraction, why = offload_fraction("cuda", device, host)
    assert fraction == 0.8 and why == ""   # floor(20 x (120 - 8) / 134.6) / 20
    cfg = parse_args(offload_argv("cuda", "m.jsonl", "run", fraction))
    assert cfg.optim.optimizer_cpu_offload and cfg.optim.optimizer_offload_fraction == 0.8
    m = cfg.model
    assert (m.block, m.num_layers, m.hidden_size, m.num_query_groups, m.ffn_hidden_size,
            m.vocab_size, m.seq_length) == ("llama", 32, 4096, 8, 14336, 128256, 2048)
    assert cfg.precision.precision == "bf16" and cfg.parallel.use_distributed_optimizer
    validate.validate_run(cfg, LaunchEnv(), memory=device, host_memory=host)
    with pytest.raises(ConfigError, match="^--optimizer-cpu-offload keeps about 135 GiB in host"):
        validate.validate_run(parse_args(offload_argv("cuda", "m.jsonl", "run", 1.0)), LaunchEnv(),
                              memory=device, host_memory=host)
    # a device with too little free memory for any fraction the host holds: skipped, with the line
    fraction, why = offload_fraction("cuda", (60 * GIB, "free on cuda:0"), host)
    assert fraction is None and why.startswith("this run needs about"), why


def test_offload_stage_is_last_and_starts_only_with_its_time():
    stage = plan()[-1]
    assert stage.name == "offload" and stage.optional and stage.min_s == 300.0
    assert deadline_for(stage, 540.0) == 480.0               # --only offload: the whole call
    assert deadline_for(stage, 300.0) is None                # what the stages before it leave


def test_offload_stage_on_the_cpu(tmp_path):
    from benchmarks.device_check.offload import offload_lines, offload_stage
    got = offload_stage(Stage("offload", 480.0, optional=True), 120.0, tmp_path, "cpu", _args(steps=3))
    assert got.status == "ok", got
    assert got.summary["steps"] == 2 and got.offload["fraction"] == 0.5
    # the share is the optimizer's time (the host's update) over the step's, totals over the
    # steps after the first, from the run's own metrics records
    records = [json.loads(line) for line in (tmp_path / "offload.jsonl").read_text().splitlines()][1:]
    assert got.offload["host_update_share"] == pytest.approx(
        sum(r["time_optimizer_s"] for r in records) / sum(r["step_time_s"] for r in records),
        rel=1e-9), got.offload
    assert offload_lines([got])[0].startswith("optimizer offload, over the steps after the first: "
                                              "--optimizer-offload-fraction 0.5 (host memory")


def test_targets_are_not_read_from_unfinished_stages(tmp_path):
    """A stage stopped at its deadline keeps the summary of the steps it made; its figures are
    shown, marked, not read against the targets."""
    from benchmarks.device_check.moe import comparison_lines
    summary = {"tokens_per_s": 100.0, "mfu": 0.2, "peak_memory_bytes": GIB,
               "model_tflops_per_device": None, "step_time_s": 1.0}
    results = [StageResult("moe", "deadline", 90.0, 90.0, summary=summary),
               StageResult("moe_dense", "ok", 75.0, 30.0, summary=dict(summary, tokens_per_s=120.0))]
    header = {"device_name": "unknown device"}
    lines = comparison_lines(results, header, tmp_path, True, 2, 4)
    assert lines[0].startswith("MoE / dense (same active FLOPs) tokens/s: 0.833 (target >= 0.8)")
    assert lines[0].endswith("NOT a result against the targets: from stages that did not finish "
                             "(moe deadline)"), lines
    results[0].status = "ok"
    assert "NOT" not in comparison_lines(results, header, tmp_path, True, 2, 4)[0]
