"""Data parallelism through the real trainer on this machine: weak scaling, a bucket-size sweep and
the gradient bytes per step of each compressor.

    python -m benchmarks.data_parallel                          # dp 1, 2, 4
    python -m benchmarks.data_parallel --dp 1 2 4 8 --hidden-size 256 --steps 6

- Weak scaling: every rank keeps the same work (micro-batch size x micro-batches), so the global
  batch grows with dp; tokens/s per rank at dp=N over tokens/s at dp=1 is the efficiency.
- Bucket sweep (dp=2): more, smaller buckets start communicating earlier in backward but pay a
  per-collective cost; the table gives buckets, collectives and bytes per step and the step time.
- Compression: ``dp_comm_bytes`` per step (ring-model bytes this rank hands to gradient
  collectives) for none / int8 / top-k, with the ratio to none, at every dp > 1.

Each configuration trains a few steps on dp gloo processes (one spawned group per dp, one thread
per process); times and tokens/s are totals over the steps after the first (tokens over seconds,
``engine.metrics.summarize_run``), bytes and collectives medians per step. With more ranks than CPU cores the
ranks share cores, which lowers the efficiency beyond what communication alone costs: read the
scaling columns as an upper bound on the overhead, not as a property of the reducer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli import parse_args  # noqa: E402
from engine.metrics import summarize_run  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from parallel.topology import RankGrid  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

BUCKETS_MB = (0.05, 0.25, 1.0, 25.0)
COMPRESSORS = (("none", []), ("int8", ["--grad-compression", "int8"]),
               ("topk 1%", ["--grad-compression", "topk", "--grad-compression-ratio", "0.01"]),
               ("topk 10%", ["--grad-compression", "topk", "--grad-compression-ratio", "0.1"]))


def flags(args, dp: int, *extra: str) -> list[str]:
    micro = args.micro_batch_size
    return ["--mock-data", "--vocab-size", "1024", "--no-progress", "--device", "cpu",
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * args.m * dp),
            "--dp", str(dp), "--train-iters", str(args.steps), "--lr-warmup-iters", "0",
            "--peak-tflops", "1", *extra]


def run_rank(ps, jobs: list[tuple[str, list[str]]]) -> list[dict]:
    out = []
    for label, argv in jobs:
        trainer = Trainer(parse_args(argv))
        collectives, finish = [], trainer.reducer.finish

        def counted_finish():
            finish()
            collectives.append(trainer.reducer.stats()["collectives"])

        trainer.reducer.finish = counted_finish
        records = trainer.train().records
        total = summarize_run(records, warmup=1)        # the first step warms up
        records = records[1:]
        out.append({"label": label, "buckets": len(trainer.reducer.buckets),
                    "step_time": total["step_time_s"], "tokens_per_s": total["tokens_per_s"],
                    "bytes": statistics.median(r["dp_comm_bytes"] for r in records),
                    "collectives": statistics.median(collectives[1:])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--m", type=int, default=2, help="micro-batches per step on each rank")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cores = os.cpu_count() or 1

    results: dict[int, dict[str, dict]] = {}
    for dp in args.dp:
        jobs = [("scaling", flags(args, dp))]
        if dp == 2:
            jobs += [(f"bucket {mb}", flags(args, dp, "--bucket-size-mb", str(mb))) for mb in BUCKETS_MB]
        if dp > 1:
            jobs += [(f"compress {name}", flags(args, dp, *extra)) for name, extra in COMPRESSORS]
        out = run_distributed(run_rank, grid=RankGrid(dp=dp), args=(jobs,), timeout_s=600)
        results[dp] = {r["label"]: r for r in out[0]}

    print("## Weak scaling (same work per rank)\n")
    print("| dp | global batch | step time (s) | tokens/s | tokens/s per rank | efficiency | dp bytes/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = results[min(args.dp)]["scaling"]["tokens_per_s"] / min(args.dp)
    for dp in args.dp:
        r = results[dp]["scaling"]
        per_rank = r["tokens_per_s"] / dp
        print(f"| {dp} | {args.micro_batch_size * args.m * dp} | {r['step_time']:.3f} | "
              f"{r['tokens_per_s']:.0f} | {per_rank:.0f} | {per_rank / base:.2f} | {r['bytes']:,.0f} |")
    if 2 in results:
        print("\n## Bucket size (dp=2)\n")
        print("| bucket (MB) | buckets | collectives/step | bytes/step | step time (s) |")
        print("| --- | --- | --- | --- | --- |")
        for mb in BUCKETS_MB:
            r = results[2][f"bucket {mb}"]
            print(f"| {mb} | {r['buckets']} | {r['collectives']:.0f} | {r['bytes']:,.0f} | {r['step_time']:.3f} |")
    print("\n## Gradient bytes per step by compressor\n")
    print("| dp | compressor | bytes/step | ratio to none | step time (s) |")
    print("| --- | --- | --- | --- | --- |")
    for dp in (d for d in args.dp if d > 1):
        none = results[dp]["compress none"]["bytes"]
        for name, _ in COMPRESSORS:
            r = results[dp][f"compress {name}"]
            print(f"| {dp} | {name} | {r['bytes']:,.0f} | {r['bytes'] / none:.4f} | {r['step_time']:.3f} |")
    print("\nbytes: ring-model bytes this rank hands to gradient collectives per step "
          "(see parallel/dp/compression.py).")
    if max(args.dp) > cores:
        print(f"note: {cores} CPU cores for up to {max(args.dp)} ranks: ranks share cores, so the "
              f"efficiency above mixes oversubscription with communication cost.")


if __name__ == "__main__":
    main()
