"""Bandwidth of the links a training layout uses: collectives inside TP and DP groups, p2p between stages.

Numbers follow nccl-tests (doc/PERFORMANCE.md there), so a table from this module can be laid next to
one from ``all_reduce_perf`` on the same machines:

- ``bytes`` is the full buffer of the op: the all-reduce buffer, the *gathered* all-gather output, the
  reduce-scatter *input*, the message of one send/recv.
- ``algbw = bytes / time``; ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all-reduce,
  ``(n-1)/n`` for all-gather and reduce-scatter and 1 for send/recv. busbw is what a ring moves over
  the slowest link, so it does not depend on n and is comparable with the link's hardware peak.
- ``time`` is the mean over ``iters`` timed iterations after ``warmup`` untimed ones, device time
  between two events on the stream (``engine.device.clock.EventPair``), and the *maximum over all ranks* (the slowest rank is what training waits for).

Every group of a dimension runs at once (all TP groups together, all DP groups together), as they do
in training, so links that groups share are measured under their real load. p2p runs every pipeline
link at once in one direction (stage s sends to s+1), like the forward activations.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass

import torch

from engine.device.clock import DeviceClock, EventPair
from engine.device.runtime import DeviceInfo
from parallel.grid.state import ParallelState

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
OPS = COLLECTIVES + ("send_recv",)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64K' -> 65536 (binary units K, M, G, as nccl-tests' -b/-e flags)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text.upper())
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"message size {text!r} is not a positive size such as 1024, 64K, 1M or 2G")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(part) for part in text.split(",") if part.strip())


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for an op over n ranks (nccl-tests' definition)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown op {op!r}; use one of {OPS}")


def bandwidths(op: str, n: int, nbytes: int, time_s: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second)."""
    algbw = nbytes / time_s / 1e9
    return algbw, algbw * bus_factor(op, n)


def message_elements(op: str, n: int, nbytes: int, elem_size: int) -> int:
    """Elements of the full buffer: ``nbytes`` rounded down so all-gather/reduce-scatter split evenly."""
    elems = max(1, nbytes // elem_size)
    if op in ("all_gather", "reduce_scatter"):
        elems = max(n, elems - elems % n)
    return elems


@dataclass(frozen=True)
class BenchConfig:
    sizes: tuple[int, ...] = (1 << 10, 64 << 10, 1 << 20, 16 << 20)
    iters: int = 20
    warmup: int = 5
    ops: tuple[str, ...] = OPS
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"--sizes needs at least one positive size, got {self.sizes}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need --iters >= 1 and --warmup >= 0, got {self.iters} and {self.warmup}")
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(f"--ops must name some of {','.join(OPS)}, got {','.join(self.ops)}")


@dataclass
class BenchResult:
    """One row of the table and one object of the --json list (the planner's --calibrate-links input)."""
    op: str
    group: str
    group_size: int
    bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float

    def to_json(self) -> dict:
        return asdict(self)


def plan(ps: ParallelState, cfg: BenchConfig) -> list[tuple[str, str, int]]:
    """(op, group, bytes) in the order every rank runs them; dimensions of size 1 have no links."""
    steps = []
    for dim in ("tp", "dp"):
        if getattr(ps, f"{dim}_size") > 1:
            steps += [(op, dim, size) for size in cfg.sizes for op in COLLECTIVES if op in cfg.ops]
    if ps.pp_size > 1 and "send_recv" in cfg.ops:
        steps += [("send_recv", "pp", size) for size in cfg.sizes]
    return steps


def _make_op(ps: ParallelState, op: str, dim: str, nbytes: int, dtype: torch.dtype):
    """A closure running one iteration of the op on this rank, with its buffers allocated once."""
    dev = ps.device
    esize = torch.tensor([], dtype=dtype).element_size()
    if op == "send_recv":
        elems = message_elements(op, 2, nbytes, esize)
        send, recv = torch.ones(elems, dtype=dtype, device=dev), torch.empty(elems, dtype=dtype, device=dev)
        ops = []
        if not ps.is_last_stage:
            ops.append(("send", send, ps.stage_rank(ps.pp_rank + 1)))
        if not ps.is_first_stage:
            ops.append(("recv", recv, ps.stage_rank(ps.pp_rank - 1)))

        def run():
            for req in ps.pp_group.batch_isend_irecv(ops):
                req.wait()
        return run, elems * esize
    group, n = getattr(ps, f"{dim}_group"), getattr(ps, f"{dim}_size")
    elems = message_elements(op, n, nbytes, esize)
    full = torch.ones(elems, dtype=dtype, device=dev)  # (elems,)
    shard = torch.empty(elems // n, dtype=dtype, device=dev)  # (elems / n,)
    if op == "all_reduce":
        return (lambda: group.all_reduce(full)), elems * esize
    if op == "all_gather":
        return (lambda: group.all_gather_into(full, shard)), elems * esize
    return (lambda: group.reduce_scatter_into(shard, full)), elems * esize


def _timed(run, ps: ParallelState, dev: DeviceInfo, cfg: BenchConfig) -> float:
    for _ in range(cfg.warmup):
        run()
    dev.synchronize()
    ps.world_group.barrier()  # every group starts together, so shared links carry their real load
    timer = EventPair(DeviceClock(dev.type)).start()  # device time: events on the stream
    for _ in range(cfg.iters):
        run()
    return timer.stop().elapsed_s() / cfg.iters


def run_benchmarks(ps: ParallelState, dev: DeviceInfo, cfg: BenchConfig) -> list[BenchResult]:
    """Collective over the whole job: every rank runs the same plan; every rank gets the results."""
    steps = plan(ps, cfg)
    if not steps:
        return []
    local, sizes = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # newer torch renames the *_tensor collectives
        for op, dim, nbytes in steps:
            run, actual = _make_op(ps, op, dim, nbytes, cfg.dtype)
            local.append(_timed(run, ps, dev, cfg))
            sizes.append(actual)
    every = ps.world_group.all_gather_object(local)
    results = []
    for i, (op, dim, _) in enumerate(steps):
        worst = max(times[i] for times in every)
        n = 2 if op == "send_recv" else getattr(ps, f"{dim}_size")
        algbw, busbw = bandwidths(op, n, sizes[i], worst)
        results.append(BenchResult(op, dim, n, sizes[i], worst, algbw, busbw))
    return results


def check_collectives(ps: ParallelState) -> list[str]:
    """Run each op once on known data and return what came back wrong (empty when all is right).

    Catches groups wired to the wrong ranks and links that corrupt data before any timing is trusted.
    """
    problems, dev = [], ps.device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for dim in ("tp", "dp"):
            n, group = getattr(ps, f"{dim}_size"), getattr(ps, f"{dim}_group")
            if n == 1:
                continue
            ranks = ps.grid.group_of(ps.rank, dim)
            me = ranks.index(ps.rank)
            total = float(sum(r + 1 for r in ranks))
            buf = torch.full((n,), float(ps.rank + 1), device=dev)  # (n,)
            group.all_reduce(buf)
            if buf.cpu().tolist() != [total] * n:
                problems.append(f"{dim} all_reduce over {ranks} gave {buf.cpu().tolist()}, expected {total}")
            gathered = torch.empty(n, device=dev)  # (n,)
            group.all_gather_into(gathered, torch.full((1,), float(ps.rank), device=dev))
            if gathered.cpu().tolist() != [float(r) for r in ranks]:
                problems.append(f"{dim} all_gather over {ranks} gave {gathered.cpu().tolist()}")
            mine = torch.empty(1, device=dev)  # (1,)
            src = torch.arange(n, device=dev, dtype=torch.float32) + ps.rank + 1  # (n,)
            group.reduce_scatter_into(mine, src)
            if mine.item() != total + n * me:
                problems.append(f"{dim} reduce_scatter over {ranks} gave {mine.item()} on position {me}, "
                                f"expected {total + n * me}")
        if ps.pp_size > 1:
            got = torch.full((1,), -1.0, device=dev)
            ops = []
            if not ps.is_last_stage:
                ops.append(("send", torch.full((1,), float(ps.rank), device=dev),
                            ps.stage_rank(ps.pp_rank + 1)))
            if not ps.is_first_stage:
                ops.append(("recv", got, ps.stage_rank(ps.pp_rank - 1)))
            for req in ps.pp_group.batch_isend_irecv(ops):
                req.wait()
            if not ps.is_first_stage and got.item() != ps.stage_rank(ps.pp_rank - 1):
                problems.append(f"send_recv from stage {ps.pp_rank - 1} delivered {got.item()}, expected "
                                f"rank {ps.stage_rank(ps.pp_rank - 1)}")
    return problems


def format_table(results: list[BenchResult]) -> str:
    head = f"{'op':<15}{'group':>6}{'n':>4}{'size':>8}{'time_us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.op:<15}{r.group:>6}{r.group_size:>4}{format_size(r.bytes):>8}"
                     f"{r.time_s * 1e6:>12.1f}{r.algbw_gbps:>12.4g}{r.busbw_gbps:>12.4g}")
    return "\n".join(lines)
