"""The communication layer's own cost per call: a small collective through ``CommGroup`` (the rule
check, the lane check, the byte counters, the hang-tracking activity, the stream-order hooks)
against the bare ``torch.distributed`` call on the same process group, in one run.

A tensor-parallel step issues hundreds of small collectives, so per-call host work multiplies. Two
gloo ranks on this CPU run blocks of ``--calls`` all-reduces (and all-gathers) of a small tensor,
alternately through the engine and bare, the side that goes first swapping block by block (the
machine is shared: load drifts over seconds). Reported per op and per rule setting: microseconds
per call on each side (each side's total time over its total calls) and their ratio, engine / bare,
the median over block pairs, and the layer's bookkeeping alone: the same checks, counters and
activity around a collective that does nothing (the part of the cost that is the engine's, free of
gloo's latency and of the machine's load). The ratio depends on gloo's latency on this machine.

    python -m benchmarks.communication.call_cost [--calls 200] [--blocks 15] [--numel 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import BenchParser, at_least, markdown_table
from parallel.runtime.comm import _all_gather_single

RULES = (None, "hccl")
# what CommGroup.all_gather_into calls (torch 2.13's all_gather_single, not the deprecated wrapper
# all_gather_into_tensor, whose own cost would be charged to the bare side)
_ALL_GATHER = _all_gather_single


def _block(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - start


def _measure(ps, op: str, numel: int, calls: int, blocks: int) -> dict:
    group = ps.tp_group
    t = torch.ones(numel)
    out = torch.empty(numel * group.size)
    if op == "all_reduce":
        engine = lambda: group.all_reduce(t)  # noqa: E731
        bare = lambda: dist.all_reduce(t, group=group.process_group)  # noqa: E731
    else:
        engine = lambda: group.all_gather_into(out, t)  # noqa: E731
        bare = lambda: _ALL_GATHER(out, t, group=group.process_group)  # noqa: E731
    _block(engine, calls // 4), _block(bare, calls // 4)  # warm both paths
    ratios, tot = [], {"engine": 0.0, "bare": 0.0}
    for b in range(blocks):
        order = (("engine", engine), ("bare", bare)) if b % 2 == 0 else (("bare", bare), ("engine", engine))
        got = {}
        for name, fn in order:
            got[name] = _block(fn, calls)
            tot[name] += got[name]
        ratios.append(got["engine"] / got["bare"])
    n = calls * blocks
    return {"engine_us": 1e6 * tot["engine"] / n, "bare_us": 1e6 * tot["bare"] / n,
            "ratio": statistics.median(ratios), "bookkeeping_us": _bookkeeping_us(group, op, t, out, calls * blocks)}


def _bookkeeping_us(group, op: str, t, out, calls: int) -> float:
    """The layer's own host time per call: the same checks, counters and activity as a real call
    around a collective that does nothing (no peer involved, so no network latency in it)."""
    def nothing(*args, **kwargs):
        return None

    tensors = None if op == "all_reduce" else [t, out]
    start = time.perf_counter()
    for _ in range(calls):
        group._issue(op, t, reduce_op=dist.ReduceOp.SUM if op == "all_reduce" else None,
                     tensors=tensors)
        group._run(op, nothing, t)
    return 1e6 * (time.perf_counter() - start) / calls


def _worker(rank: int, port: int, args, out: str) -> None:
    from parallel.grid.launch import LaunchEnv
    from parallel.grid.state import ParallelState
    from parallel.grid.topology import RankGrid
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from parallel.runtime.backend_rules import get_rules
    rows = []
    ps = ParallelState.initialize(RankGrid(tp=2), torch.device("cpu"), "gloo", LaunchEnv.from_env())
    for rules in RULES:
        ps.tp_group.monitor.rules = get_rules(rules)  # shared by the state's groups
        for op in ("all_reduce", "all_gather"):
            rows.append({"rules": rules or "off", "op": op,
                         **_measure(ps, op, args.numel, args.calls, args.blocks)})
    ps.destroy()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)


def run(args) -> list[dict]:
    import socket
    import tempfile
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(port, args, out), nprocs=2, start_method="spawn")
        with open(out) as fh:
            return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="calls per timed block")
    p.add_argument("--blocks", type=int, default=15, help="timed blocks per side")
    p.add_argument("--numel", type=int, default=64, help="fp32 elements per collective")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    at_least(p, args, calls=1, blocks=1, numel=1)
    rows = run(args)
    print(f"per-call cost, 2 gloo ranks, {args.numel} fp32 elements, {args.blocks} x {args.calls} calls "
          f"per side (rank 0's figures)")
    print(markdown_table(["rules", "op", "CommGroup (us/call)", "bare (us/call)", "ratio (median)",
                          "bookkeeping alone (us/call)"],
                         [[r["rules"], r["op"], f"{r['engine_us']:.1f}", f"{r['bare_us']:.1f}",
                           f"{r['ratio']:.3f}", f"{r['bookkeeping_us']:.1f}"] for r in rows]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
