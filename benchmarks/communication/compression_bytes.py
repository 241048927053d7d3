"""Bytes, error and time of the gradient compressors against an uncompressed all-reduce, on gloo.

    python -m benchmarks.communication.compression_bytes --dp 2 4 --numel 4000000

For each data-parallel size, every rank draws a gradient-like buffer (magnitudes spread over four
decades) and the exchange is run through each compressor, in both forms: the two-phase all-reduce
(every rank gets the sum) and ZeRO's phase 1 (each rank gets its shard). Printed per compressor:
the ring-model bytes this rank sent (the communication layer's ``wire_bytes``), their ratio to a
ring all-reduce of the fp32 buffer, the relative L2 error of the result at the last step (error
feedback carries the rest to later steps), and the median wall time over ``--reps``.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import BenchParser, at_least  # noqa: E402
from parallel.runtime.comm_monitor import wire_bytes  # noqa: E402
from parallel.dp import Int8Compressor, OneBitCompressor, TopKCompressor  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import gather_tensors, record_comm, run_distributed  # noqa: E402

MAKERS = (("none", None), ("int8", lambda: Int8Compressor(256)), ("topk 1%", lambda: TopKCompressor(0.01)),
          ("topk 10%", lambda: TopKCompressor(0.1)),
          # beta1 0: the sign exchange of the buffer itself (in training it carries the momentum)
          ("onebit", lambda: OneBitCompressor(256, beta1=0.0)))


def _buffer(rank: int, numel: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + step)
    return torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)[torch.randperm(numel, generator=g)]


def run_rank(ps, numel: int, reps: int) -> list[tuple]:
    group, p = ps.dp_group, ps.dp_size
    rows = []
    for name, make in MAKERS:
        for form in ("all-reduce", "zero") if make else ("all-reduce",):
            comp = make() if make else None
            times, sent, err = [], 0, 0.0
            for step in range(reps):
                x = _buffer(ps.rank, numel, step)
                truth = torch.stack(gather_tensors(group, x)).sum(0)
                out = x.clone()
                with record_comm(ps) as events:
                    start = time.perf_counter()
                    if comp is None:
                        group.all_reduce(out)
                    elif form == "zero":
                        shard = torch.empty(numel // p)
                        comp.reduce_scatter_(out, group, shard)
                    else:
                        comp.all_reduce_(out, group)
                    times.append(time.perf_counter() - start)
                sent = sum(e.wire_bytes for e in events)
                if form == "zero":
                    lo = ps.dp_rank * (numel // p)
                    ref = truth[lo:lo + numel // p]
                    err = float((shard - ref).norm() / ref.norm())
                else:
                    err = float((out - truth).norm() / truth.norm())
            rows.append((name, form, sent, sent / wire_bytes("all_reduce", numel * 4, p), err,
                         statistics.median(times)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    at_least(parser, args, dp=2, reps=1)
    if args.numel < max(args.dp):
        parser.error(f"--numel must be at least the largest --dp ({max(args.dp)}): every rank "
                     f"holds a shard, got {args.numel}")
    print("| dp | compressor | form | bytes sent | ratio | rel. error (last step) | median time (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for world in args.dp:
        numel = args.numel // world * world
        rows = run_distributed(run_rank, grid=RankGrid(dp=world), args=(numel, args.reps), timeout_s=1800)[0]
        for name, form, nbytes, ratio, err, t in rows:
            print(f"| {world} | {name} | {form} | {nbytes:,} | {ratio:.4f} | {err:.2e} | {t:.3f} |")


if __name__ == "__main__":
    main()
