"""What a run says before its first step and in its summary: every choice that changes what runs
(experts and top-k, ep and etp, FP8, the ZeRO stage, gradient compression and its warm-up, the TP
overlap), and what a step will cost at the device's peak (attention at the run's sequence length
included), so that a size the memory check passes but that takes minutes per step is said before
the first step."""
from engine.config.cli import parse_args
from engine.plan.flops import step_flops
from engine.training.step_record import cost_line, start_line
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.summary import summary_cells

MOCK = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size",
        "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2"]


def start_and_summary(ps, cases):
    out = []
    for argv in cases:
        trainer = Trainer(parse_args(MOCK + argv))
        line = start_line(trainer)
        summary = trainer.train().summary
        trainer.close()
        out.append((line, summary))
    return out


def test_the_start_line_and_the_summary_name_every_choice():
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--ep", "2", "--moe-layer-freq", "[0,1]",
           "--use-distributed-optimizer", "--zero-stage", "2", "--grad-compression", "int8",
           "--grad-compression-warmup-steps", "1"]
    overlap = ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap", "--bf16", "--fp8-format",
               "hybrid", "--fp8-recipe", "rowwise", "--first-last-layers-bf16",
               "--num-layers-at-start-in-bf16", "0"]
    (moe_run, tp_run), _ = run_distributed(start_and_summary, grid=RankGrid(dp=2),
                                           args=([moe, overlap],), timeout_s=60)
    choices = ("MoE 4 experts top-2 on layers [1], ep 2 etp 1; ZeRO-2 (optim_grads); gradient compression int8 "
               "after 1 uncompressed step")
    assert moe_run[0] == ("gridtron: tp=1 pp=1 dp=2 (order tp-dp-pp, 2 ranks) on cpu; 1 "
                          "micro-batches/step; 160,064 parameters on rank 0; " + choices)
    assert summary_cells(moe_run[1])["choices"] == choices, moe_run[1]
    choices = ("FP8 GEMMs hybrid rowwise (bf16 in the last 1 layer); ZeRO-0 (optimizer state on "
               "every DP rank); no gradient compression; TP overlap: fused ops where the device "
               "has them, else chunked ring")
    assert tp_run[0] == ("gridtron: tp=2 pp=1 dp=1 (order tp-dp-pp, 2 ranks) on cpu; 2 "
                         "micro-batches/step; 68,928 parameters on rank 0; " + choices)
    assert summary_cells(tp_run[1])["choices"] == choices, tp_run[1]


def test_the_cost_is_said_before_the_first_step(capsys):
    """The start line and the estimated step time are the run's first lines; a 100,000-token
    sequence on a tiny model is minutes per step, said before the first one."""
    trainer = Trainer(parse_args(MOCK + ["--peak-tflops", "0.001"]))
    trainer.train()
    trainer.close()
    lines = capsys.readouterr().err.splitlines()
    # the planner's count over the vocabulary as allocated (300 padded to 384 columns), the
    # attention core (Q K^T and scores x V: 4 s h per token and layer, three passes) at half, as
    # a causal kernel runs it: what the line divides
    flops = step_flops(4, 32, 2, 64, 384, 256, "gpt2", "none").executed - 3 * 2 * 4 * 4 * 32 * 32 * 64 / 2
    assert f"{flops:.3g}" == "9.75e+07"
    assert lines[:2] == [
        "gridtron: tp=1 pp=1 dp=1 (order tp-dp-pp, 1 rank) on cpu; 2 micro-batches/step; 126,720 "
        "parameters on rank 0; ZeRO-0 (optimizer state on every DP rank); no gradient compression",
        "gridtron: estimated step time at least 97.5 ms (9.75e+07 FLOPs per step, causal attention "
        "at half, over 1 device at 0.001 TFLOP/s peak); 2 steps: at least 195 ms"], lines
    long = Trainer(parse_args(MOCK[:MOCK.index("--seq-length")] + [
        "--seq-length", "100000", "--max-position-embeddings", "100000", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--peak-tflops", "0.03"]))
    try:
        flops = step_flops(1, 100000, 2, 64, 384, 256, "gpt2", "none").executed  # 300: 384 columns
        assert f"{flops:.3g}" == "1.54e+13"  # attention's 4 s h per token: 2.56e+12 per layer
        # attention dominates: its core, 3 passes x 2 layers x 2.56e+12, counts at half
        least = flops - 3 * 2 * 4 * 100000 * 100000 * 64 / 2
        assert long.flops.least == least and f"{least:.3g}" == "7.75e+12"
        assert cost_line(long, 10) == ("gridtron: estimated step time at least 4.31 min (7.75e+12 "
                                       "FLOPs per step, causal attention at half, over 1 device at "
                                       "0.03 TFLOP/s peak); 10 steps: at least 43.1 min")
    finally:
        long.close()


def test_the_summary_names_the_peak_and_says_when_nothing_was_written(tmp_path):
    """MFU's denominator is in the summary with its source (a given peak here; on a CPU without
    one, a measurement that moves with the load), and a run without --run-dir says that it wrote
    nothing; with one, the outputs row is left out (the files have rows of their own)."""
    trainer = Trainer(parse_args(MOCK + ["--peak-tflops", "0.25"]))
    bare = trainer.train().summary
    trainer.close()
    cells = summary_cells(bare)
    assert cells["peak (MFU, HFU)"] == "0.25 TFLOP/s per device (--peak-tflops)", bare
    assert cells["outputs"] == "none written (--run-dir DIR writes metrics, plots and checkpoints)"
    trainer = Trainer(parse_args(MOCK + ["--run-dir", str(tmp_path)]))
    written = trainer.train().summary
    trainer.close()
    assert "none written" not in written and "measured at start by a matmul" in written, written


def test_the_progress_bar_is_a_terminals_unless_asked_for(monkeypatch):
    """By default the bar is drawn only on a terminal (a captured log gets the console lines);
    --progress draws it anyway, --no-progress never."""
    import sys
    for tty, extra, want in ((True, [], True), (False, [], False), (False, ["--progress"], True),
                             (True, ["--no-progress"], False)):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty, raising=False)
        argv = [a for a in MOCK if a != "--no-progress"] + extra
        trainer = Trainer(parse_args(argv))
        try:
            assert trainer.progress is want, (tty, extra)
        finally:
            trainer.close()
