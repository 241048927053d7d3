"""tp=2 tokens/s of this tree against a previous release, on the same machine, in one run.

The previous release's tree is taken from git (``git archive REV``) into a temporary directory;
both trees train the same recipe (4 layers x 128 hidden, sequence 64, global batch 32, mock data,
fp32, no checkpoint) with ``torchrun --nproc-per-node 2 -m engine.train --tp 2``, jobs alternating
between the trees (``--repeats`` each), so a load change on a shared machine hits both. Each job's
tokens/s is its total tokens over its total step time after ``--warmup`` steps (from the metrics
file; records whose step time is not known yet are left out), the figure per tree the median over
its jobs, and the ratio this tree / release. With more ranks than cores or a busy machine the
absolute figures are distorted; the ratio in one run is what this measures.

    python -m benchmarks.peers.release [--rev 1659ac0] [--repeats 3] [--steps 30] [--warmup 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, TORCHRUN, BenchParser, at_least, positive_seconds, steps_past_warmup

RECIPE = ["--mock-data", "--num-layers=4", "--hidden-size=128", "--num-attention-heads=4",
          "--seq-length=64", "--micro-batch-size=4", "--global-batch-size=32", "--tp=2",
          "--precision=fp32", "--vocab-size=512", "--no-progress"]


def export_tree(rev: str, dest: Path) -> Path:
    """The files of ``rev`` under ``dest`` (nothing of the working tree)."""
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def job(tree: Path, steps: int, metrics: Path, log: Path, timeout_s: float) -> None:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "engine.train", *RECIPE,
           f"--train-iters={steps}", "--metrics-file", str(metrics), "--run-dir", str(metrics.parent / metrics.stem)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree), TORCH_CPP_LOG_LEVEL="ERROR")
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{' '.join(cmd)} in {tree} exited {proc.returncode}:\n{tail}")


def tokens_per_s(metrics: Path, warmup: int) -> float:
    """Total tokens over total step time of the steps after ``warmup`` (rank 0's records)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) > warmup and r.get("step_time_s")]
    return sum(r["tokens"] for r in rows) / sum(r["step_time_s"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="1659ac0", help="the previous release to compare against")
    p.add_argument("--repeats", type=int, default=3, help="jobs per tree, alternating")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    at_least(p, args, repeats=1, warmup=0)
    steps_past_warmup(p, args, "tokens/s is")
    positive_seconds(p, args, "timeout_s")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "release").mkdir()
        trees = {"this tree": REPO, f"release {args.rev}": export_tree(args.rev, tmp / "release")}
        got = {name: [] for name in trees}
        for rep in range(args.repeats):
            order = list(trees.items()) if rep % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                metrics = tmp / f"{name.split()[0]}-{rep}.jsonl"
                job(Path(tree), args.steps, metrics, metrics.with_suffix(".log"), args.timeout_s)
                got[name].append(tokens_per_s(metrics, args.warmup))
    med = {name: statistics.median(v) for name, v in got.items()}
    now, old = med["this tree"], med[f"release {args.rev}"]
    print(f"tp=2, 4 x 128, seq 64, global batch 32, {args.steps} steps ({args.warmup} warm-up), "
          f"{args.repeats} alternating jobs per tree")
    for name, v in got.items():
        print(f"  {name}: median {med[name]:.0f} tokens/s (jobs: {', '.join(f'{x:.0f}' for x in v)})")
    print(f"  ratio this tree / release: {now / old:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
