"""Does gradient compression change what data parallelism learns? The same recipe trained with each
compressor at dp=2, loss curves plotted together.

    python -m benchmarks.compression                              # 200 steps, a few minutes here
    python -m benchmarks.compression --steps 1000 --hidden-size 128 --out runs/bench

Runs: no compression, int8, top-k (``--topk-ratio``, with error feedback) and the per-branch policy
of ``--policy`` (a YAML recipe's ``grad_compression_policy``; default configs/compression_policy.yaml).
The data is real text: a byte-level corpus of a few standard-library packages, prepared into
``--out`` on first use (or ``--data-path``), since random tokens cannot show a learning difference.

Printed: the final training loss (mean of the last ``--window`` steps, to smooth batch noise), the
validation loss after the last step, the gradient bytes per step relative to no compression, and
whether each compressed run ends within ``--target`` (2%) of the uncompressed one. The PNG holds
the smoothed training curves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from engine.cli import parse_args  # noqa: E402
from engine.data.corpus import stdlib_dir  # noqa: E402
from engine.data.prepare import prepare  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from parallel.topology import RankGrid  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

CORPUS_PACKAGES = ("json", "email", "http", "xml", "logging", "asyncio")


def run_rank(ps, jobs: list[tuple[str, list[str]]]) -> list[dict]:
    out = []
    for name, argv in jobs:
        result = Trainer(parse_args(argv)).train()
        out.append({"name": name, "loss": [r["loss"] for r in result.records],
                    "bytes": [r["dp_comm_bytes"] for r in result.records],
                    "valid": result.valid[-1][1] if result.valid else None})
    return out


def corpus(out_dir: str) -> str:
    prefix = Path(out_dir) / "compression_corpus" / "corpus"
    if not Path(f"{prefix}.json").exists():
        prepare([stdlib_dir() / p for p in CORPUS_PACKAGES], prefix, "byte", max_bytes=4_000_000,
                extensions=(".py",))
    return str(prefix)


def smooth(values: list[float], window: int) -> list[float]:
    return [statistics.mean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--policy", default="configs/compression_policy.yaml",
                        help="YAML recipe whose grad_compression_policy is run too ('' to skip)")
    parser.add_argument("--data-path", default=None, help="prepared corpus (default: a byte corpus)")
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the final loss")
    parser.add_argument("--target", type=float, default=0.02, help="allowed relative final-loss gap")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = args.data_path or corpus(args.out)

    base = ["--data-path", data, "--no-progress", "--device", "cpu", "--dp", str(args.dp),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.steps),
            "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
            "--lr-warmup-iters", str(max(1, args.steps // 20)), "--eval-interval", str(args.steps),
            "--eval-iters", "8", "--peak-tflops", "1"]
    jobs = [("none", base), ("int8", base + ["--grad-compression", "int8"]),
            (f"topk {args.topk_ratio:g}", base + ["--grad-compression", "topk",
                                                  "--grad-compression-ratio", str(args.topk_ratio)])]
    if args.policy:
        with open(args.policy) as fh:
            policy = yaml.safe_load(fh)["grad_compression_policy"]
        jobs.append((f"policy ({Path(args.policy).name})",
                     base + ["--grad-compression-policy", json.dumps(policy)]))
    runs = run_distributed(run_rank, grid=RankGrid(dp=args.dp), args=(jobs,), timeout_s=3600)[0]

    window = min(args.window, args.steps)
    ref = runs[0]
    ref_final = statistics.mean(ref["loss"][-window:])
    ref_bytes = statistics.mean(ref["bytes"])
    print(f"dp={args.dp}, {args.steps} steps, final loss = mean of the last {window} steps\n")
    print("| compressor | final train loss | gap to none | validation loss | bytes/step vs none "
          "| within target |")
    print("| --- | --- | --- | --- | --- | --- |")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        final = statistics.mean(run["loss"][-window:])
        gap = (final - ref_final) / ref_final
        ok = "-" if run is ref else ("yes" if abs(gap) <= args.target else "no")
        valid = f"{run['valid']:.4f}" if run["valid"] is not None else "-"
        print(f"| {run['name']} | {final:.4f} | {gap:+.2%} | {valid} | "
              f"{statistics.mean(run['bytes']) / ref_bytes:.4f} | {ok} |")
        ax.plot(range(1, args.steps + 1), smooth(run["loss"], max(1, window // 2)), label=run["name"],
                linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (running mean of {max(1, window // 2)})")
    ax.set_title(f"gradient compression, dp={args.dp}")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(args.out, "compression_loss.png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(f"\ntarget: compressed runs end within {args.target:.0%} of the uncompressed final loss. "
          f"bytes: ring-model gradient bytes per step (policy runs include uncompressed warm-up "
          f"steps). Curves: {path}")


if __name__ == "__main__":
    main()
