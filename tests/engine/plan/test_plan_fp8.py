"""FP8 in the planner (engine/plan/fp8.py): the tensor-parallel linears' GEMM time from the FP8
peak, the attention core and the output layer at the bf16 rate, ``--calibrate`` fitting the FP8
fraction, the memory of the float8 copies and scales, and the refusal on a chip without FP8.

The figures are worked by hand from the model's shape (h 1024, ffn 4096, 24 layers, seq 2048,
micro-batch 4, global batch 16 on one device): a layer's linears hold 4 h^2 + 2 h f =
12,582,912 weights, so one micro-batch's forward runs 2 x 8192 tokens x that many FLOPs in them
and backward twice that."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.plan.hardware import get_device_spec, peak_tflops
from engine.plan.model import Cluster, Layout, ModelShape
from engine.plan.timing import estimate
from engine.tools import plan_cli

L, H, F, S, MBS, GBS = 24, 1024, 4096, 2048, 4, 16
TOKENS = S * MBS                            # per micro-batch
LINEAR_WEIGHTS = 4 * H * H + 2 * H * F      # QKV + output projection + MLP in and out
LAYOUT = Layout(tp=1, pp=1, dp=1, micro_batch_size=MBS)
ARGV = ["--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", "16",
        "--ffn-hidden-size", str(F), "--seq-length", str(S), "--vocab-size", "51200",
        "--global-batch-size", str(GBS), "--device", "h100", "--devices", "1", "--layout", "1,1",
        "--micro-batch-size", str(MBS), "--recompute", "none", "--zero", "off",
        "--sequence-parallel", "off"]


def shape(fp8: str | None = None, **kw) -> ModelShape:
    return ModelShape(L, H, 16, 51200, S, GBS, F, "gpt2", fused_attention=True, fp8_recipe=fp8, **kw)


def cluster(**kw) -> Cluster:
    return Cluster.from_device(get_device_spec("h100"), 1, **kw)


def test_the_table_has_fp8_peaks_where_the_chip_has_fp8():
    assert peak_tflops("h100", "fp8") == pytest.approx(2 * peak_tflops("h100", "bf16"), rel=1e-3)
    assert peak_tflops("NVIDIA H200", "fp8") == 1979.0
    assert peak_tflops("a100-80gb", "fp8") is None and peak_tflops("ascend910b3", "fp8") is None
    assert cluster().fp8_peak_tflops == 1979.0


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fp8_gemms_take_half_the_bf16_time_at_twice_the_peak(recompute):
    """FP8 peak = 2 x bf16 peak, equal fractions: the step is shorter by exactly half of the
    linears' bf16 GEMM time (forward, both backward GEMMs and, under full recomputation, the
    forward again without the MLP's down projection); nothing else moves."""
    c = cluster(fp8_peak_tflops=2 * 989.0)
    layout = replace(LAYOUT, recompute=recompute)
    bf16, fp8 = estimate(shape(), c, layout), estimate(shape("tensorwise"), c, layout)
    passes = 3 * LINEAR_WEIGHTS + (LINEAR_WEIGHTS - H * F if recompute == "full" else 0)
    linear_s = L * (GBS // MBS) * 2 * TOKENS * passes / (989e12 * c.achievable_fraction)
    assert bf16.step_time_s - fp8.step_time_s == pytest.approx(linear_s / 2, rel=1e-9)
    assert fp8.flops == bf16.flops   # the same FLOPs, run faster


def test_only_the_linears_change_rate():
    """Under FP8 at any FP8 peak the attention core and the logits keep the bf16 rate: with the
    FP8 peak so high that the linears cost nothing, the step is the bf16 step less all of the
    linears' GEMM time."""
    c = cluster(fp8_peak_tflops=1e12)
    bf16, fp8 = estimate(shape(), c, LAYOUT), estimate(shape("rowwise"), c, LAYOUT)
    linear_s = L * (GBS // MBS) * 2 * TOKENS * 3 * LINEAR_WEIGHTS / (989e12 * c.achievable_fraction)
    assert bf16.step_time_s - fp8.step_time_s == pytest.approx(linear_s, rel=1e-6)


def test_fp8_memory_is_one_gemms_copies_and_the_scales():
    """fc1 and fc2 (1024 x 4096) are the largest linears: their weight gradient holds dy and x in
    float8 and each once more transposed, 2 x 8192 x (1024 + 4096) bytes. Scales kept per layer:
    tensorwise x and W of the four linears, 8 fp32; rowwise one per token of x and one per output
    row of each linear; blockwise one per 128 x 128 block of each weight (QKV 24 x 8, the output
    projection 8 x 8, fc1 32 x 8, fc2 8 x 32: 768). Everything else is the bf16 run's."""
    plain = estimate(shape(), cluster(), LAYOUT).memory
    for recipe, scales in (("tensorwise", 4 * 8), ("rowwise", 4 * (4 * TOKENS + 3 * H + H + F + H)),
                           ("blockwise", 4 * (192 + 64 + 256 + 256))):
        mem = estimate(shape(recipe), cluster(), LAYOUT).memory
        assert mem.fp8 == 2 * TOKENS * (H + F) + L * scales, recipe
        assert replace(mem, fp8=0.0) == plain
    assert plain.fp8 == 0.0


def test_calibrate_fits_the_fp8_fraction_of_an_fp8_run(tmp_path, capsys):
    """A run that took the step the model predicts at FP8 fraction 0.35 (the bf16 parts at the
    default fraction) is fitted back to 0.35."""
    c = cluster()
    step = estimate(shape("tensorwise"), replace(c, fp8_achievable_fraction=0.35), LAYOUT).step_time_s
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "step_time_s": step}) + "\n" for i in (1, 2, 3)))
    assert plan_cli.main(ARGV + ["--fp8-format", "hybrid", "--calibrate", str(metrics)]) == 0
    out = capsys.readouterr()
    assert "calibrated FP8 achievable fraction 0.350 " in out.err, out.err
    assert f"the bf16 parts at fraction {c.achievable_fraction:.3f}" in out.err
    assert "--fp8-format hybrid --fp8-recipe tensorwise" in out.out  # the printed command


def test_a_chip_without_fp8_is_one_line(capsys):
    assert plan_cli.main(ARGV + ["--device", "a100-80gb", "--fp8-format", "e4m3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gridtron: --fp8-format: a100-80gb has no FP8 peak in engine/plan/hardware.py "
                   "(FP8 needs compute capability 8.9 or later: H100, H200); give "
                   "--fp8-peak-tflops or drop --fp8-format"], err
    assert plan_cli.main(ARGV + ["--device", "a100-80gb", "--fp8-format", "e4m3",
                                 "--fp8-peak-tflops", "600"]) == 0


# 48 x 4224 (66 heads of 64), sequence 8192, on 8 H100s: the fastest layout is tp 2, whose shards
# of the QKV width (12672 / 2) and of the hidden size (4224 / 2) cut blockwise's 128 tiles
TILES = ["--num-layers", "48", "--hidden-size", "4224", "--num-attention-heads", "66",
         "--seq-length", "8192", "--vocab-size", "50304", "--global-batch-size", "8",
         "--device", "h100", "--devices", "8", "--fp8-format", "e4m3", "--json", "--top", "50"]


def _train_config(command: str):
    """engine.train's own parser and checks on a printed command (its ValueError: a refusal)."""
    import shlex
    from torch.distributed.run import get_args_parser
    from engine.config.cli import parse_args
    return parse_args(get_args_parser().parse_args(shlex.split(command)[1:]).training_script_args)


def test_blockwise_plans_only_layouts_the_trainer_accepts(capsys):
    """The trainer refuses --fp8-recipe blockwise where a TP or CP shard cuts a 128 tile
    (engine/config/fp8.py blockwise_problem): the planner drops those layouts as it drops any
    other that breaks a rule, so its best blockwise layout is one the trainer accepts, while the
    best rowwise layout (no tile rule) would be refused under blockwise."""
    assert plan_cli.main(TILES + ["--fp8-recipe", "rowwise"]) == 0
    rowwise = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rowwise[0]["tp"] == 2
    with pytest.raises(ValueError, match="--fp8-recipe blockwise at --tp 2"):
        _train_config(rowwise[0]["command"].replace("--fp8-recipe rowwise", "--fp8-recipe blockwise"))
    assert plan_cli.main(TILES + ["--fp8-recipe", "blockwise"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all(row["tp"] == 1 for row in rows)
    for row in rows[:5]:
        cfg = _train_config(row["command"])
        assert (cfg.precision.fp8_recipe, cfg.parallel.tp) == ("blockwise", row["tp"])
    # pinned to the cut layout: the trainer's line, as for any layout a rule rejects
    assert plan_cli.main(TILES + ["--fp8-recipe", "blockwise", "--layout", "2,1"]) == 2
    err = capsys.readouterr().err
    assert "layout rejected: --fp8-recipe blockwise at --tp 2 needs each rank's share" in err, err
