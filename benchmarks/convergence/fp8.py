"""Does FP8 train what bf16 trains? The same recipe in bf16 and in FP8 (tensorwise and rowwise,
--fp8-format hybrid; blockwise, --fp8-format e4m3) at (tp, pp, dp) = (1,1,1) and (2,1,2) with
sequence parallelism, on the built-in corpus; the final losses against the bf16 run of the same
layout.

    python -m benchmarks.convergence.fp8                      # 300 steps: the target of docs/precision.md
    python -m benchmarks.convergence.fp8 --steps 30           # a quick look
    python -m benchmarks.convergence.fp8 --recipes bf16 "fp8 blockwise" --hidden-size 256
        # blockwise: tp 2 needs each rank's widths in 128s (docs/precision.md), so hidden 256

Every run draws the same global batches (layout-independent sampling), so the runs of one layout
see the same tokens at every step and their last losses compare directly. Printed per run: the
last step's loss, the mean of the last ``--window`` steps (batch noise smoothed), each one's
relative gap to the bf16 run of its layout, whether the last loss is within ``--target`` of
bf16's, and tokens/s (on a CPU, torch._scaled_mm's CPU kernel: not a speed figure for a GPU).
The JSON in ``--out`` holds every loss curve. The default model (2 x 64, seq 64, global batch
8) keeps the six 300-step runs at about 19 CPU-minutes on 2 cores (docs/benchmarks.md, "FP8
against bf16 on the CPU"). Too long for CI: tests/engine/training/test_fp8_train.py checks 20
steps of smaller runs instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config.cli import parse_args  # noqa: E402
from engine.training.trainer import Trainer  # noqa: E402
from parallel.grid.launch import LaunchEnv  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

RECIPES = {"bf16": [], "fp8 tensorwise": ["--fp8-format", "hybrid"],
           "fp8 rowwise": ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
           "fp8 blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]}
DEFAULT_RECIPES = ("bf16", "fp8 tensorwise", "fp8 rowwise")
LAYOUTS = {"(1,1,1)": [], "(2,1,2) sp": ["--tp", "2", "--dp", "2", "--sequence-parallel"]}


def base(args) -> list[str]:
    return ["--no-progress", "--device", "cpu", "--bf16", "--tokenizer", args.tokenizer,
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.steps),
            "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--lr-warmup-iters",
            str(args.steps // 20), "--seed", str(args.seed), "--log-interval", str(args.steps)]


def summary(records: list[dict]) -> dict:
    return {"loss": [r["loss"] for r in records],
            "tokens_per_s": sum(r["tokens"] for r in records[1:])
            / max(1e-9, sum(r["step_time_s"] for r in records[1:]))}


def run_rank(ps, jobs: list[list[str]]) -> list[dict]:
    return [summary(Trainer(parse_args(argv)).train().records) for argv in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tokenizer", default="byte",
                        help="of the built-in corpus (byte keeps the CPU's bf16 output layer small)")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.01)
    parser.add_argument("--out", default="runs/fp8_bench")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), choices=list(RECIPES),
                        help="the runs of each layout (bf16 is the reference every gap is to)")
    args = parser.parse_args()
    if "bf16" not in args.recipes:
        parser.error("--recipes must include bf16, the reference every gap is measured to")
    recipes = {name: RECIPES[name] for name in args.recipes}
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    results: dict = {}
    for layout, flags in LAYOUTS.items():
        jobs = [base(args) + flags + recipe for recipe in recipes.values()]
        if not flags:
            runs = [summary(Trainer(parse_args(argv), launch=LaunchEnv()).train().records)
                    for argv in jobs]
        else:
            runs = run_distributed(run_rank, grid=RankGrid(tp=2, dp=2), args=(jobs,),
                                   timeout_s=3600.0, deadline_s=24 * 3600.0)[0]
        results[layout] = dict(zip(recipes, runs))
        print(f"{layout}: {time.time() - start:.0f} s", flush=True)
    rows = ["| layout | run | last loss | gap to bf16 | mean of last "
            f"{args.window} | gap | within {args.target:.0%} | tokens/s |",
            "| --- | --- | ---: | ---: | ---: | ---: | :---: | ---: |"]
    for layout, runs in results.items():
        ref = runs["bf16"]["loss"]
        for name, run in runs.items():
            last, mean = run["loss"][-1], statistics.mean(run["loss"][-args.window:])
            gap = last / ref[-1] - 1
            gap_mean = mean / statistics.mean(ref[-args.window:]) - 1
            ok = "" if name == "bf16" else ("yes" if abs(gap) <= args.target else "no")
            rows.append(f"| {layout} | {name} | {last:.4f} | {gap:+.2%} | {mean:.4f} | "
                        f"{gap_mean:+.2%} | {ok} | {run['tokens_per_s']:.0f} |")
    print("\n".join(rows))
    name = "fp8.json" if args.recipes == list(DEFAULT_RECIPES) else \
        "fp8_" + "_".join(r.replace("fp8 ", "") for r in args.recipes) + ".json"
    with open(os.path.join(args.out, name), "w") as fh:
        json.dump({"args": vars(args), "results": results, "table": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
