"""``--tp-comm-overlap``: tokens/s with and without it at tp=2 and (tp, pp, dp) = (2, 2, 2), in one
run, and a timeline of one overlapped layer showing the chunk transfers beside the GEMMs.

Throughput: the recipe of benchmarks/peers/release.py (4 layers x 128 hidden, sequence 64, global
batch 32, mock data, fp32) with ``--sequence-parallel``, one ``torchrun --standalone`` job per
(layout, overlap), the two settings of a layout alternating (``--repeats`` each); each job's
tokens/s is its total tokens over its total step time after ``--warmup`` steps, the figure per
setting the median job, and the ratio overlap / plain per layout, reported whatever it is.

Timeline: two gloo ranks run one column-parallel forward + backward and one row-parallel forward
+ backward, (b, s, h) = ``--timeline-shape``, through the overlapped layers (ring). Every GEMM of
the main thread (``aten.mm`` / ``addmm`` / ``bmm``, stamped by a dispatch mode) and every
point-to-point transfer of the ring (from its post to its completion, stamped by a watcher thread
that waits for it; the layer's own ``wait()`` joins that thread) is a span on one clock; rank 0
writes them as a Chrome trace (``tp_overlap_trace.json``, chrome://tracing or Perfetto) and a PNG
(``tp_overlap_timeline.png``) under ``--out``. A transfer bar beside a GEMM bar is a chunk
travelling while the previous one is multiplied.

    python -m benchmarks.communication.tp_overlap [--repeats 2] [--steps 12] [--warmup 3] [--out runs/tp_overlap]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import BenchParser, at_least, positive_seconds, steps_past_warmup, torchrun
from benchmarks.peers.release import RECIPE, tokens_per_s

LAYOUTS = {"tp=2": ["--tp=2"], "(2,2,2)": ["--tp=2", "--pp=2", "--dp=2"]}


def job(layout: list[str], overlap: bool, steps: int, metrics: Path, timeout_s: float) -> None:
    world = 8 if "--pp=2" in layout else 2
    recipe = [a for a in RECIPE if a != "--tp=2"] + layout + ["--sequence-parallel"]
    torchrun(world, ["-m", "engine.train", *recipe, *(["--tp-comm-overlap"] if overlap else []),
                     f"--train-iters={steps}", "--metrics-file", str(metrics),
                     "--run-dir", str(metrics.parent / metrics.stem)],
             metrics.with_suffix(".log"), timeout_s)


# ---- the timeline ------------------------------------------------------------------------------

class _Spans:
    """(row, label, start ns, end ns) of one rank, from one clock (``time.perf_counter_ns``)."""

    def __init__(self):
        self.spans: list = []
        self.lock = threading.Lock()

    def add(self, row: str, label: str, start: int, end: int) -> None:
        with self.lock:
            self.spans.append((row, label, start, end))


class _Watched:
    """A transfer's handle whose completion a watcher thread waits for and stamps; ``wait()``
    joins that thread."""

    def __init__(self, work, label: str, spans: _Spans):
        self.start = time.perf_counter_ns()
        self.thread = threading.Thread(target=self._watch, args=(work, label, spans), daemon=True)
        self.thread.start()

    def _watch(self, work, label: str, spans: _Spans) -> None:
        work.wait()
        spans.add("chunk transfers (p2p)", label, self.start, time.perf_counter_ns())

    def wait(self, *args, **kwargs) -> bool:
        self.thread.join()
        return True

    def is_completed(self) -> bool:
        return not self.thread.is_alive()


def _watch_transfers(spans: _Spans):
    """Route torch.distributed.batch_isend_irecv through ``_Watched`` handles (this process)."""
    import torch.distributed as dist
    real = dist.batch_isend_irecv
    count = [0]

    def watched(ops):
        count[0] += 1
        works = real(ops)
        kinds = "+".join("send" if op.op is dist.isend else "recv" for op in ops)
        return [_Watched(w, f"transfer #{count[0]} ({kinds})", spans) for w in works]
    dist.batch_isend_irecv = watched


def _gemm_timer(spans: _Spans):
    """A dispatch mode stamping every GEMM the thread runs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    gemms = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class GemmTimer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in gemms:
                return func(*args, **(kwargs or {}))
            start = time.perf_counter_ns()
            out = func(*args, **(kwargs or {}))
            spans.add("GEMMs (main thread)", str(func.overloadpacket.__name__), start,
                      time.perf_counter_ns())
            return out
    return GemmTimer()


def _timeline_rank(rank: int, port: int, shape: tuple, out: str) -> None:
    import torch
    import torch.distributed as dist
    from parallel.runtime.comm import CommGroup
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import (ColumnParallelLinear, Initializer, RowParallelLinear,
                                          set_tp_comm_overlap)
    from parallel.grid.topology import RankGrid
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps = ParallelState(RankGrid(tp=2, dp=1), rank=rank,
                       tp_group=CommGroup("tp", (0, 1), rank, None, world=True))
    b, s, h = shape
    init = Initializer(seed=1, std=0.02)
    col = ColumnParallelLinear(h, 4 * h, ps, "fc1", init, sequence_parallel=True)
    row = RowParallelLinear(4 * h, h, ps, "fc2", init, sequence_parallel=True)
    set_tp_comm_overlap([col, row], "ring")
    x = torch.randn(b, s // 2, h, requires_grad=True)  # (b, s/tp, h)
    for _ in range(2):  # warm-up
        row(col(x)).sum().backward()
    spans = _Spans()
    _watch_transfers(spans)
    dist.barrier()
    with _gemm_timer(spans):
        t = time.perf_counter_ns()
        y = row(col(x))  # (b, s/tp, h)
        spans.add("phase", "column + row forward", t, time.perf_counter_ns())
        t = time.perf_counter_ns()
        y.sum().backward()
        spans.add("phase", "column + row backward", t, time.perf_counter_ns())
    dist.barrier()
    if rank == 0:
        _write(spans.spans, out, shape)
    dist.destroy_process_group()


def _write(spans: list, out: str, shape: tuple) -> None:
    """A Chrome trace (one row per kind) and a PNG of the same spans."""
    import json
    t0 = min(s[2] for s in spans)
    rows = ["phase", "GEMMs (main thread)", "chunk transfers (p2p)"]
    events = [{"name": label, "ph": "X", "pid": 0, "tid": rows.index(row), "ts": (a - t0) / 1e3,
               "dur": (e - a) / 1e3} for row, label, a, e in spans]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": r}}
               for i, r in enumerate(rows)]
    with open(os.path.join(out, "tp_overlap_trace.json"), "w") as fh:
        json.dump({"traceEvents": events}, fh)
    gemms = [(a, e) for r, _, a, e in spans if r == rows[1]]
    moving = [(a, e) for r, _, a, e in spans if r == rows[2]]
    covered = sum(min(e - a, sum(max(0, min(e, e2) - max(a, a2)) for a2, e2 in moving))
                  for a, e in gemms)
    summary = (f"{len(gemms)} GEMMs, {sum(e - a for a, e in gemms) / 1e6:.1f} ms; "
               f"{covered / 1e6:.1f} ms of it with a chunk transfer in flight; {len(moving)} "
               f"transfer handles")
    with open(os.path.join(out, "tp_overlap_timeline.txt"), "w") as fh:
        fh.write(summary + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 2.6))
    colors = {"phase": "0.85", "GEMMs (main thread)": "tab:blue", "chunk transfers (p2p)": "tab:orange"}
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        bars = [((a - t0) / 1e6, (e - a) / 1e6) for r, _, a, e in spans if r == row]
        ax.broken_barh(bars, (y + 0.1, 0.8), color=colors[row], edgecolor="k", linewidth=0.3)
        if row == "phase":
            for r, label, a, _ in spans:
                if r == row:
                    ax.text((a - t0) / 1e6, y + 0.5, " " + label, fontsize=7, va="center")
    ax.set_yticks([i + 0.5 for i in range(len(rows))], rows[::-1])
    ax.set_xlabel("ms (rank 0)")
    b, s, h = shape
    ax.set_title(f"--tp-comm-overlap ring, tp=2, gloo on CPU: column {h}->{4 * h} + row "
                 f"{4 * h}->{h}, (b, s, h) = ({b}, {s}, {h})", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "tp_overlap_timeline.png"), dpi=120)


def timeline(out: Path, shape: tuple) -> None:
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_timeline_rank, args=(port, shape, str(out)), nprocs=2, join=True)


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="jobs per (layout, setting), alternating")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--timeline-shape", type=int, nargs=3, default=(4, 256, 256), metavar=("B", "S", "H"))
    p.add_argument("--out", default="runs/tp_overlap")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    at_least(p, args, repeats=1, warmup=0, timeline_shape=1)
    steps_past_warmup(p, args, "tokens/s is")
    positive_seconds(p, args, "timeout_s")
    out = Path(args.out)
    timeline(out, tuple(args.timeline_shape))
    print(f"timeline: {out / 'tp_overlap_timeline.png'}, trace {out / 'tp_overlap_trace.json'}: "
          f"{(out / 'tp_overlap_timeline.txt').read_text().strip()}")
    print(f"4 x 128, seq 64, global batch 32, --sequence-parallel, fp32, {args.steps} steps "
          f"({args.warmup} warm-up), {args.repeats} alternating jobs per setting")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            got = {False: [], True: []}
            for rep in range(args.repeats):
                for overlap in ((False, True) if rep % 2 == 0 else (True, False)):
                    metrics = Path(tmp) / f"{name.strip('()').replace(',', '')}-{int(overlap)}-{rep}.jsonl"
                    job(LAYOUTS[name], overlap, args.steps, metrics, args.timeout_s)
                    got[overlap].append(tokens_per_s(metrics, args.warmup))
            plain, ovl = statistics.median(got[False]), statistics.median(got[True])
            print(f"  {name}: plain {plain:.0f} tokens/s (jobs {', '.join(f'{v:.0f}' for v in got[False])}), "
                  f"--tp-comm-overlap {ovl:.0f} tokens/s (jobs {', '.join(f'{v:.0f}' for v in got[True])}), "
                  f"ratio {ovl / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
