"""Bytes, error and time of the gradient compressors against an uncompressed all-reduce, on gloo.

    python -m benchmarks.compression_bytes --dp 2 4 --numel 4000000

For each data-parallel size, every rank draws a gradient-like buffer (magnitudes spread over four
decades) and the exchange is run through each compressor. Printed per compressor: bytes this rank
sent (ring model, see parallel/dp/compression.py), their ratio to a ring all-reduce of the fp32
buffer, the relative L2 error of the summed result, and the median wall time over ``--reps``.
Top-k is run for several steps, so its error includes the benefit of error feedback.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.dp.compression import CommStats, Int8Compressor, TopKCompressor, ring_bytes  # noqa: E402


def _buffer(rank: int, numel: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 7919 + step)
    return torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)[torch.randperm(numel, generator=g)]


def _worker(rank: int, world: int, port: int, numel: int, reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for name, make in (("none", None), ("int8", lambda: Int8Compressor(256)),
                       ("topk 1%", lambda: TopKCompressor(0.01)), ("topk 10%", lambda: TopKCompressor(0.1))):
        comp = make() if make else None
        times, stats, err = [], CommStats(), 0.0
        for step in range(reps):
            x = _buffer(rank, numel, step)
            truth = x.clone()
            dist.all_reduce(truth)
            out, stats = x.clone(), CommStats()
            start = time.perf_counter()
            if comp is None:
                dist.all_reduce(out)
                stats.add("all_reduce", out.numel() * 4, world)
            else:
                comp.all_reduce_(out, None, stats)
            times.append(time.perf_counter() - start)
            err = float((out - truth).norm() / truth.norm())
        rows.append((name, stats.bytes, stats.bytes / ring_bytes("all_reduce", numel * 4, world), err,
                     statistics.median(times)))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print("| dp | compressor | bytes sent | ratio | rel. error (last step) | median time (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    ctx = mp.get_context("spawn")
    for world in args.dp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args.numel, args.reps, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = queue.get()
        for p in procs:
            p.join()
        for name, nbytes, ratio, err, t in rows:
            print(f"| {world} | {name} | {nbytes:,} | {ratio:.4f} | {err:.2e} | {t:.3f} |")


if __name__ == "__main__":
    main()
