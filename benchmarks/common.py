"""Helpers shared by the launch-based benchmarks (communication/scaling.py, peers/compare.py and
others): layouts, torchrun subprocesses, per-step metrics files, steady-state throughput and
markdown tables.

Every run is a separate ``torchrun --standalone`` job writing one JSON object per optimizer step, so
a benchmark measures exactly what a user's launch would, including the process group and the real
collectives. The first steps of each run (warm-up: allocator growth, first-touch of buffers, lazy
initialisation in the communication library) are dropped before anything is averaged.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.base import ToolParser  # noqa: E402
from engine.observe.metrics import steady, summarize_run  # noqa: E402,F401 (steady: the benchmarks' warm-up cut)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class BenchParser(ToolParser):
    """The tools' parser (engine/base.py: no abbreviated flags) for the benchmarks, whose mains
    print no ConfigError: a bad argument is one line on stderr (``PROG: error: ...``, no usage
    block) and exit status 2, before anything is launched."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def at_least(parser: argparse.ArgumentParser, args, **minimums: int) -> None:
    """``parser.error`` for the first argument below its minimum: ``dest=low`` checks
    ``args.dest`` (an int, or each int of a list) as ``--dest`` (underscores as dashes)."""
    for dest, low in minimums.items():
        value = getattr(args, dest)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v < low:
                parser.error(f"--{dest.replace('_', '-')} must be at least {low}, got {v}")


def steps_past_warmup(parser: argparse.ArgumentParser, args, measures: str = "the figures are") -> None:
    """``parser.error`` unless ``args.steps`` exceeds ``args.warmup``: ``measures`` says what is
    taken over the steps after the warm-up (``"tokens/s is"``)."""
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: {measures} taken "
                     f"over the steps after the warm-up")


def positive_seconds(parser: argparse.ArgumentParser, args, dest: str) -> None:
    """``parser.error`` unless ``args.<dest>`` is a positive number of seconds (NaN is not)."""
    value = getattr(args, dest)
    if not value > 0:
        parser.error(f"--{dest.replace('_', '-')} must be a positive number of seconds, got {value}")


@dataclass(frozen=True)
class Layout:
    """A (tp, pp, dp) grid; ``world`` processes."""
    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key} must be a positive integer, got {value!r}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tag(self) -> str:  # file-name friendly
        return f"tp{self.tp}-pp{self.pp}-dp{self.dp}"

    def __str__(self) -> str:
        return f"({self.tp},{self.pp},{self.dp})"

    def flags(self) -> list[str]:
        return ["--tp", str(self.tp), "--pp", str(self.pp), "--dp", str(self.dp)]


def parse_layout(text: str) -> Layout:
    """``"2,1,1"`` -> Layout(tp=2, pp=1, dp=1) (order tp,pp,dp)."""
    parts = text.replace("x", ",").split(",")
    if len(parts) != 3:
        raise ValueError(f"a layout is three integers tp,pp,dp (e.g. 2,1,1), got {text!r}")
    try:
        tp, pp, dp = (int(p) for p in parts)
    except ValueError as exc:
        raise ValueError(f"a layout is three integers tp,pp,dp (e.g. 2,1,1), got {text!r}") from exc
    return Layout(tp, pp, dp)


def parse_int_list(text: str, name: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8]; positive and without repeats."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"{name} takes comma-separated integers such as 1,2,4,8, got {text!r}") from exc
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{name} needs distinct positive integers, got {text!r}")
    return values


# ---- metrics ---------------------------------------------------------------------------------

def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]



def summarize(records: list[dict], warmup: int) -> dict:
    """Steady-state figures of one run: the trainer's own closing summary
    (``engine.observe.metrics.summarize_run``), totals over the steps after ``warmup`` (tokens over
    seconds, FLOPs over seconds), never means of per-step rates."""
    return summarize_run(records, warmup)


def scaling_efficiency(tokens_per_s: float, procs: int, base_tokens_per_s: float) -> float:
    """Throughput over ``procs`` times the one-process throughput (1.0 = linear scaling)."""
    if procs < 1 or base_tokens_per_s <= 0:
        raise ValueError(f"efficiency needs procs >= 1 and a positive baseline, got {procs}, "
                         f"{base_tokens_per_s}")
    return tokens_per_s / (procs * base_tokens_per_s)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """max_i |a_i - b_i| / |b_i| over the common steps (b is the reference)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"loss sequences of different or zero length: {len(a)} vs {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# ---- output ----------------------------------------------------------------------------------

def fmt(value, spec: str = ".3g", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells for {len(headers)} headers")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_note(max_world: int, threads_per_rank: int = 1, device_type: str = "cpu",
                 backend: str | None = None) -> str:
    """One paragraph on where the numbers came from: the machine, the ranks' device type and
    backend (the device type's own unless given), the threads per rank, with the
    oversubscription caveat where the ranks' threads outnumber the CPU cores (on the CPU)."""
    import torch
    from engine.device.runtime import BACKENDS
    cores = os.cpu_count() or 1
    backend = backend or BACKENDS.get(device_type, "?")
    host = "" if device_type == "cpu" else "host "
    threads = (f"one {host}thread per rank" if threads_per_rank == 1
               else f"{threads_per_rank} {host}threads per rank")
    where = (f"{cores} CPU cores" if device_type == "cpu"
             else f"one {device_type} device per rank ({cores} CPU cores)")
    note = (f"Measured on {platform.machine()} with {where}, torch {torch.__version__}, "
            f"{backend}, {threads}.")
    if device_type == "cpu" and max_world * threads_per_rank > cores:
        more = (f"more ranks than cores ({max_world} > {cores})" if threads_per_rank == 1 else
                f"more threads than cores ({max_world} ranks x {threads_per_rank} > {cores})")
        note += (f" Runs with {more} time-share the cores, "
                 f"so their wall-clock throughput and scaling efficiency are distorted: they "
                 f"measure oversubscription as much as the parallel layout.")
    return note


# ---- launching -------------------------------------------------------------------------------

class LaunchFailed(RuntimeError):
    """A torchrun job exited non-zero; the message carries the tail of its log."""


def torchrun(nproc: int, target: list[str], log_path: str | os.PathLike, timeout_s: float,
             threads_per_rank: int = 1) -> None:
    """Run ``torchrun --standalone --nproc-per-node nproc <target>`` from the repository root,
    its output going to ``log_path``. ``target`` is ``["-m", "engine.train", ...]`` or a script
    path with its arguments."""
    cmd = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}"] + target
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank), PYTHONPATH=str(REPO),
               TORCH_CPP_LOG_LEVEL="ERROR")
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise LaunchFailed(f"{' '.join(cmd)} ran past {timeout_s:.0f} s; log: {log_path}") from exc
    if proc.returncode != 0:
        tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-25:])
        raise LaunchFailed(f"{' '.join(cmd)} exited with {proc.returncode}; log {log_path} ends:\n{tail}")


def single_thread_peak_tflops() -> float:
    """The CPU 'peak' for MFU: one thread's best fp32 matmul rate (best of a few measurements, as
    other work on the machine only ever lowers it), measured once by the driver so every run of an
    invocation divides by the same number."""
    import torch
    from engine.device.runtime import measure_cpu_peak_tflops
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return max(measure_cpu_peak_tflops() for _ in range(3))
    finally:
        torch.set_num_threads(threads)
