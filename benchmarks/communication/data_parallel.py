"""Data parallelism through the real trainer on this machine: weak scaling, a bucket-size sweep,
ZeRO 0/1/2 memory per rank next to the formulas, step time with and without overlap, and the
gradient bytes per step of each compressor.

    python -m benchmarks.communication.data_parallel                          # dp 1, 2, 4
    python -m benchmarks.communication.data_parallel --dp 1 2 4 8 --hidden-size 256 --steps 6

- Weak scaling: every rank keeps the same work (micro-batch size x micro-batches), so the global
  batch grows with dp; tokens/s per rank at dp=N over tokens/s at dp=1 is the efficiency.
- Bucket sweep (dp=2): more, smaller buckets start communicating earlier in backward but pay a
  per-collective cost; the table gives buckets, collectives and bytes per step and the step time.
- ZeRO memory: ``param_bytes``, ``grad_bytes`` and ``optimizer_state_bytes`` of rank 0 (exact,
  parallel/dp/memory.py) for stages 0, 1, 2 at every dp, next to the formulas of the stage for the
  model's N parameters and padded bucket size P (stage 0: grads 4P, AdamW 8N + 4 per tensor;
  stage 1: 12 P / dp of state; stage 2: also grads 4 P / dp).
- Overlap (dp=2, ZeRO-1 and ZeRO-2, small buckets): median step time with the gradient reduction
  and the parameter gather overlapped (the defaults) and with both off (--no-overlap-grad-reduce
  --no-overlap-param-gather), alternating the two in repeated jobs; their ratio is the gain.
- Compression: ``dp_comm_wire_bytes`` per step (ring-model bytes this rank hands to DP
  collectives) for none / int8 / top-k after the warm-up, with the ratio to none, at every dp > 1.

Each configuration trains a few steps on dp gloo processes (one spawned group per dp, one thread
per process); times and tokens/s are totals over the steps after the first (tokens over seconds,
``engine.observe.metrics.summarize_run``), bytes and collectives medians per step over the same
steps. With more ranks than CPU cores the ranks share cores, which lowers the efficiency beyond
what communication alone costs: read the scaling columns as an upper bound on the overhead, not
as a property of the reducer.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import BenchParser, at_least  # noqa: E402
from engine.config.cli import parse_args  # noqa: E402
from engine.observe.metrics import summarize_run  # noqa: E402
from engine.training.trainer import Trainer  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

BUCKETS_MB = (0.05, 0.25, 1.0, 25.0)
WARMUP = 1
COMPRESSORS = (("none", []), ("int8", ["--grad-compression", "int8"]),
               ("topk 1%", ["--grad-compression", "topk", "--grad-compression-ratio", "0.01"]),
               ("topk 10%", ["--grad-compression", "topk", "--grad-compression-ratio", "0.1"]))
STAGES = ((0, []), (1, ["--use-distributed-optimizer"]),
          (2, ["--use-distributed-optimizer", "--zero-stage", "2"]))
NO_OVERLAP = ["--no-overlap-grad-reduce", "--no-overlap-param-gather"]


def flags(args, dp: int, *extra: str) -> list[str]:
    micro = args.micro_batch_size
    return ["--mock-data", "--vocab-size", "1024", "--no-progress", "--device", "cpu",
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * args.m * dp),
            "--dp", str(dp), "--train-iters", str(args.steps), "--lr-warmup-iters", "0",
            "--peak-tflops", "1", "--grad-compression-warmup-steps", str(WARMUP), *extra]


def run_rank(ps, jobs: list[tuple[str, list[str]]]) -> list[dict]:
    out = []
    for label, argv in jobs:
        trainer = Trainer(parse_args(argv))
        collectives, finish = [], trainer.reducer.finish

        def counted_finish():
            finish()
            collectives.append(trainer.reducer.stats()["calls"])

        trainer.reducer.finish = counted_finish
        records = trainer.train().records
        total = summarize_run(records, warmup=WARMUP)   # the first step warms up
        trainer.reducer.remove_hooks()
        chunks = trainer.chunks
        out.append({"label": label, "buckets": len(trainer.reducer.buckets),
                    "step_time": total["step_time_s"], "tokens_per_s": total["tokens_per_s"],
                    # the same steps: after the one (uncompressed) warm-up step
                    "bytes": statistics.median(r["dp_comm_wire_bytes"] for r in records[WARMUP:]),
                    "collectives": statistics.median(collectives[WARMUP:]),
                    "memory": {k: records[-1][k] for k in ("param_bytes", "grad_bytes",
                                                           "optimizer_state_bytes")},
                    "n": sum(p.numel() for c in chunks for p in c.parameters()),
                    "tensors": sum(1 for c in chunks for _ in c.parameters()),
                    "padded": sum(b.numel for b in trainer.reducer.buckets)})
    return out


def formula(stage: int, dp: int, n: int, padded: int, tensors: int) -> tuple[int, int, int]:
    """(param, grad, optimizer state) bytes per rank for fp32 parameters and AdamW."""
    if stage == 0:
        return 4 * n, 4 * padded, 8 * n + 4 * tensors
    return 4 * padded, 4 * padded // (dp if stage == 2 else 1), 12 * padded // dp


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--m", type=int, default=2, help="micro-batches per step on each rank")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="alternating jobs per overlap setting")
    args = parser.parse_args(argv)
    at_least(parser, args, dp=1, num_layers=1, hidden_size=4, seq_length=1, micro_batch_size=1,
             m=1, repeats=1)
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps} must exceed the {WARMUP} warm-up step: every figure "
                     f"is taken over the steps after it")
    if args.hidden_size % 4:
        parser.error(f"--hidden-size {args.hidden_size} must be a multiple of the 4 attention heads")
    if len(set(args.dp)) != len(args.dp):
        parser.error(f"--dp needs distinct values, got {' '.join(map(str, args.dp))}")
    cores = os.cpu_count() or 1

    results: dict[int, dict[str, dict]] = {}
    for dp in args.dp:
        jobs = [("scaling", flags(args, dp))]
        jobs += [(f"zero {stage}", flags(args, dp, *extra)) for stage, extra in STAGES]
        if dp == 2:
            jobs += [(f"bucket {mb}", flags(args, dp, "--bucket-size-mb", str(mb))) for mb in BUCKETS_MB]
            for rep in range(args.repeats):
                for stage in (1, 2):
                    zero = ["--use-distributed-optimizer", "--zero-stage", str(stage), "--bucket-size-mb", "0.25"]
                    pair = [(f"overlap on {stage} {rep}", flags(args, dp, *zero)),
                            (f"overlap off {stage} {rep}", flags(args, dp, *zero, *NO_OVERLAP))]
                    jobs += pair if rep % 2 == 0 else pair[::-1]
        if dp > 1:
            jobs += [(f"compress {name}", flags(args, dp, *extra)) for name, extra in COMPRESSORS]
        out = run_distributed(run_rank, grid=RankGrid(dp=dp), args=(jobs,), timeout_s=1800)
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
    print("\n## ZeRO memory per rank (rank 0; measured = memory_bytes of the built objects)\n")
    print("| dp | stage | params (B) | grads (B) | optimizer state (B) | formula (params / grads / state) | match |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dp in args.dp:
        for stage, _ in STAGES:
            r = results[dp][f"zero {stage}"]
            m = r["memory"]
            want = formula(stage, dp, r["n"], r["padded"], r["tensors"])
            got = (m["param_bytes"], m["grad_bytes"], m["optimizer_state_bytes"])
            print(f"| {dp} | {stage} | {got[0]:,} | {got[1]:,} | {got[2]:,} | "
                  f"{want[0]:,} / {want[1]:,} / {want[2]:,} | {'yes' if got == want else 'NO'} |")
    if 2 in results:
        print("\n## Bucket size (dp=2)\n")
        print("| bucket (MB) | buckets | collectives/step | bytes/step | step time (s) |")
        print("| --- | --- | --- | --- | --- |")
        for mb in BUCKETS_MB:
            r = results[2][f"bucket {mb}"]
            print(f"| {mb} | {r['buckets']} | {r['collectives']:.0f} | {r['bytes']:,.0f} | {r['step_time']:.3f} |")
        print(f"\n## Overlap (dp=2, 0.25 MB buckets, median over {args.repeats} alternating jobs)\n")
        print("| ZeRO stage | step time, overlap on (s) | step time, overlap off (s) | off / on |")
        print("| --- | --- | --- | --- |")
        for stage in (1, 2):
            on = statistics.median(results[2][f"overlap on {stage} {k}"]["step_time"] for k in range(args.repeats))
            off = statistics.median(results[2][f"overlap off {stage} {k}"]["step_time"] for k in range(args.repeats))
            print(f"| {stage} | {on:.4f} | {off:.4f} | {off / on:.3f} |")
    print(f"\n## DP bytes per step by compressor (after {WARMUP} uncompressed warm-up step)\n")
    print("| dp | compressor | bytes/step | ratio to none | step time (s) |")
    print("| --- | --- | --- | --- | --- |")
    for dp in (d for d in args.dp if d > 1):
        none = results[dp]["compress none"]["bytes"]
        for name, _ in COMPRESSORS:
            r = results[dp][f"compress {name}"]
            print(f"| {dp} | {name} | {r['bytes']:,.0f} | {r['bytes'] / none:.4f} | {r['step_time']:.3f} |")
    print("\nbytes: ring-model bytes this rank hands to DP collectives per step (dp_comm_wire_bytes).")
    if max(args.dp) > cores:
        print(f"note: {cores} CPU cores for up to {max(args.dp)} ranks: ranks share cores, so the "
              f"efficiency above mixes oversubscription with communication cost.")


if __name__ == "__main__":
    main()
