"""Does gradient compression change what data parallelism learns? The same recipe trained with each
compressor at dp=2 and dp=4 for several seeds; final-loss gaps, bytes, step times and loss curves.

    python -m benchmarks.convergence.compression                               # 600 steps, dp 2 and 4, 3 seeds
    python -m benchmarks.convergence.compression --steps 200 --dp 2 --seeds 1  # a quick look

Runs per (dp, seed): no compression, int8, top-k (``--topk-ratio``), onebit (1-bit Adam,
parallel/dp/onebit.py) and the per-branch policy of
``--policy`` (a YAML recipe's ``grad_compression_policy``; default configs/compression_policy.yaml);
at the dp sizes of ``--ablation-dp`` also top-k with 0/1 Adam's ``exp`` refreshes of the second
moment and top-k with DGC's momentum factor masking, to show what the defaults (off) avoid.
The compressed runs use the engine's defaults: error feedback on both sides of the exchange; int8
starts after ``--warmup`` uncompressed steps; top-k, onebit and the policy after a warm-up of
``--warmup-fraction`` of the run, then Adam's second moment is frozen and refreshed on the
``--variance-refresh`` schedule (parallel/dp/warmup.py, variance.py). The data is real text:
a byte-level corpus of a few standard-library packages, prepared into ``--out`` on first use (or
``--data-path``), since random tokens cannot show a learning difference.

Printed per run: the final training loss (mean of the last ``--window`` steps, to smooth batch
noise), its gap to the uncompressed run of the same dp and seed, the ring-model DP bytes summed
over the whole run (warm-up included) relative to that run, and the median step time; then the
mean gap over seeds and whether it is within ``--target``. The PNG holds the seed-averaged curves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from engine.config.cli import parse_args  # noqa: E402
from engine.data.corpus import stdlib_dir  # noqa: E402
from engine.data.prepare import prepare  # noqa: E402
from engine.training.trainer import Trainer  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

CORPUS_PACKAGES = ("json", "email", "http", "xml", "logging", "asyncio")


def run_rank(ps, jobs: list[tuple[str, int, list[str]]]) -> list[dict]:
    out = []
    for name, seed, argv in jobs:
        trainer = Trainer(parse_args(argv))
        records = trainer.train().records
        trainer.reducer.remove_hooks()
        out.append({"name": name, "seed": seed, "loss": [r["loss"] for r in records],
                    "wire": [r["dp_comm_wire_bytes"] for r in records],
                    "step_time": [r["step_time_s"] for r in records]})
    return out


def corpus(out_dir: str) -> str:
    prefix = Path(out_dir) / "compression_corpus" / "corpus"
    if not Path(f"{prefix}.json").exists():
        prepare([stdlib_dir() / p for p in CORPUS_PACKAGES], prefix, "byte", max_bytes=4_000_000,
                extensions=(".py",))
    return str(prefix)


def smooth(values: list[float], window: int) -> list[float]:
    return [statistics.mean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def jobs_for(args, data: str, dp: int) -> list[tuple[str, int, list[str]]]:
    jobs = []
    for seed in args.seeds:
        base = ["--data-path", data, "--no-progress", "--device", "cpu", "--dp", str(dp),
                "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
                "--micro-batch-size", str(args.micro_batch_size),
                "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.steps),
                "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
                "--lr-warmup-iters", str(max(1, args.steps // 20)), "--peak-tflops", "1",
                "--seed", str(seed),
                "--grad-compression-variance-refresh", str(args.variance_refresh)]
        frac = ["--grad-compression-warmup-fraction", str(args.warmup_fraction)]
        jobs += [("none", seed, base),
                 ("int8", seed, base + ["--grad-compression", "int8",
                                        "--grad-compression-warmup-steps", str(args.warmup)]),
                 (f"topk {args.topk_ratio:g}", seed,
                  base + frac + ["--grad-compression", "topk", "--grad-compression-ratio",
                                 str(args.topk_ratio)]),
                 ("onebit", seed, base + frac + ["--grad-compression", "onebit"])]
        if dp in args.ablation_dp:   # what 0/1 Adam's refreshes and DGC's masking would change
            topk = base + frac + ["--grad-compression", "topk", "--grad-compression-ratio",
                                  str(args.topk_ratio)]
            masked = {"default": {"compressor": "topk", "ratio": args.topk_ratio,
                                  "momentum_masking": True},
                      "warmup_fraction": args.warmup_fraction, "variance_refresh": args.variance_refresh}
            jobs += [(f"topk {args.topk_ratio:g}, refresh exp", seed,
                      topk + ["--grad-compression-variance-refresh", "exp"]),
                     (f"topk {args.topk_ratio:g}, momentum masking", seed,
                      base + ["--grad-compression-policy", json.dumps(masked)])]
        if args.policy:
            with open(args.policy) as fh:
                policy = yaml.safe_load(fh)["grad_compression_policy"]
            policy = {k: v for k, v in policy.items() if k != "warmup_steps"}
            policy = {**policy, "warmup_fraction": args.warmup_fraction,
                      "variance_refresh": args.variance_refresh}
            jobs.append((f"policy ({Path(args.policy).name})", seed,
                         base + ["--grad-compression-policy", json.dumps(policy)]))
    if args.only is not None:
        jobs = [j for j in jobs if j[0] == "none" or any(j[0].startswith(o) for o in args.only)]
    return jobs


def report(results: dict, args) -> str:
    window = min(args.window, args.steps)
    warm = max(1, round(args.warmup_fraction * args.steps))
    lines = [f"{args.steps} steps, final loss = mean of the last {window} steps; uncompressed "
             f"warm-up: int8 {args.warmup} steps, top-k, onebit and the policy "
             f"{args.warmup_fraction:g} x {args.steps} = {warm} steps; variance refresh "
             f"{args.variance_refresh}\n",
             "| dp | seed | compressor | final loss | gap to none | DP bytes vs none (whole run) "
             "| median step time (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    summary = {}
    for dp, runs in results.items():
        ref = {r["seed"]: r for r in runs if r["name"] == "none"}
        for run in runs:
            base = ref[run["seed"]]
            final = statistics.mean(run["loss"][-window:])
            gap = final / statistics.mean(base["loss"][-window:]) - 1
            ratio = sum(run["wire"]) / sum(base["wire"])
            summary.setdefault((dp, run["name"]), []).append((gap, ratio))
            lines.append(f"| {dp} | {run['seed']} | {run['name']} | {final:.4f} | {gap:+.2%} | "
                         f"{ratio:.4f} | {statistics.median(run['step_time'][1:]):.4f} |")
    lines += ["", "| dp | compressor | mean gap over seeds | bytes vs none | within target |",
              "| --- | --- | --- | --- | --- |"]
    for (dp, name), values in summary.items():
        gap = statistics.mean(g for g, _ in values)
        ratio = statistics.mean(r for _, r in values)
        ok = "-" if name == "none" else ("yes" if gap <= args.target else "no")
        lines.append(f"| {dp} | {name} | {gap:+.2%} | {ratio:.4f} | {ok} |")
    return "\n".join(lines)


def plot(results: dict, args) -> str:
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    window = max(1, min(args.window, args.steps) // 2)
    for ax, (dp, runs) in zip(axes[0], results.items()):
        for name in dict.fromkeys(r["name"] for r in runs):
            curves = [r["loss"] for r in runs if r["name"] == name]
            mean = [statistics.mean(v) for v in zip(*curves)]
            ax.plot(range(1, args.steps + 1), smooth(mean, window), label=name, linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean over seeds, running mean of {window})")
        ax.set_title(f"gradient compression, dp={dp}")
        ax.legend()
    fig.tight_layout()
    path = os.path.join(args.out, "compression_loss.png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=4, help="int8: uncompressed steps first")
    parser.add_argument("--warmup-fraction", type=float, default=0.15,
                        help="top-k, onebit, policy: uncompressed warm-up as a fraction of --steps")
    parser.add_argument("--variance-refresh", default="auto",
                        help="top-k, onebit: auto (off), exp, K, or off")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these compressors (names as printed; none always runs)")
    parser.add_argument("--ablation-dp", type=int, nargs="*", default=[2],
                        help="dp sizes that also run top-k with exp refreshes and with masking")
    parser.add_argument("--policy", default="configs/compression_policy.yaml",
                        help="YAML recipe whose grad_compression_policy is run too ('' to skip)")
    parser.add_argument("--data-path", default=None, help="prepared corpus (default: a byte corpus)")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the final loss")
    parser.add_argument("--target", type=float, default=0.02, help="allowed relative final-loss gap")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = args.data_path or corpus(args.out)
    results = {}
    for dp in args.dp:
        if args.global_batch_size % (args.micro_batch_size * dp):
            raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                             f"micro-batch x dp = {args.micro_batch_size * dp}")
        results[dp] = run_distributed(run_rank, grid=RankGrid(dp=dp), args=(jobs_for(args, data, dp),),
                                      timeout_s=7200)[0]
        with open(os.path.join(args.out, "compression.json"), "w") as fh:
            json.dump({"args": vars(args), "results": {str(k): v for k, v in results.items()}}, fh)
    text = report(results, args)
    path = plot(results, args)
    print(text)
    print(f"\ntarget: compressed runs end within {args.target:.0%} of the uncompressed final loss. "
          f"bytes: ring-model DP bytes (dp_comm_wire_bytes) summed over the run. Curves: {path}")


if __name__ == "__main__":
    main()
