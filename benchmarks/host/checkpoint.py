"""Checkpoint blocking time: how long training stops per save, synchronous against --async-save.

For each size, one process builds a GPT whose checkpointed state (fp32 parameters and both AdamW
moments: 12 bytes per parameter) is about that size, trains one step, then per repeat:

- sync: ``save_checkpoint`` (snapshot, write, fsync, hash, publish); blocking = its whole time;
- async: a ``Checkpointer`` with async_save saves the same state: the boundary that starts the save
  (host copy) and every following boundary until the save is published (polls, then the publish)
  while training steps run; blocking = the sum of those boundaries' time (what ``save_blocking_s``
  reports), measured on the same state right after the sync save.

Both checkpoints of a repeat hold the same state, so their files must hash alike (checked from the
two indexes). The saver lives for the whole run, as in training, so the first async save allocates
its host buffers and later ones reuse them: async figures are medians over the later saves (sync
over all), and the first save's blocking time is shown on its own. Also reported: the background
write's duration (snapshot to publish, as seen at step boundaries), the steps trained meanwhile,
and their mean time against steps with no write in flight (the writer shares the CPU cores with
training). Target: async blocking at most 20% of the synchronous save's at the largest size (1 GB).

    python -m benchmarks.host.checkpoint [--sizes 10MB,100MB,1GB] [--repeats 4] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks.common import BenchParser, at_least
from engine.checkpoint.async_writer import Checkpointer
from engine.checkpoint.writer import save_checkpoint
from engine.config.cli import parse_args
from engine.training.trainer import Trainer

BYTES_PER_PARAM = 12  # fp32 parameter + exp_avg + exp_avg_sq
VOCAB, SEQ = 1024, 32
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
    """``"10MB"`` -> 10_000_000 (decimal units KB, MB, GB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(KB|MB|GB)\s*", text.upper())
    if not m:
        raise ValueError(f"a size is a number with KB, MB or GB (e.g. 10MB, 1GB), got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def model_shape(state_bytes: int) -> tuple[int, int]:
    """(hidden, layers) of a GPT-2 block stack whose checkpointed state is closest to
    ``state_bytes``: params ~ layers * 12 h^2 + (vocab + seq) * h. Example: 1 GB -> (1024, 7),
    88.5M parameters, 1.06 GB."""
    params = state_bytes / BYTES_PER_PARAM
    hidden = 64
    while hidden < 1024 and 12 * (2 * hidden) ** 2 * 2 <= params:  # at least two layers of 2h
        hidden *= 2
    layers = max(1, round((params - (VOCAB + SEQ) * hidden) / (12 * hidden * hidden)))
    return hidden, layers


def build(hidden: int, layers: int, root: str) -> Trainer:
    argv = ["--mock-data", "--vocab-size", str(VOCAB), "--num-layers", str(layers),
            "--hidden-size", str(hidden), "--num-attention-heads", str(max(1, hidden // 64)),
            "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1000000", "--no-progress", "--keep-last", "1", "--save", root]
    return Trainer(parse_args(argv))


def _hashes(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "index.json")) as fh:
        return {name: f["sha256"] for name, f in json.load(fh)["files"].items()}


def measure(trainer: Trainer, saver: Checkpointer, root: str, step: int) -> tuple[dict, int]:
    """One sync save and one async save of the same state; returns the figures and the next step."""
    trainer.cfg.checkpoint.save = os.path.join(root, "sync")
    t0 = time.perf_counter()
    sync_dir = save_checkpoint(trainer, step)
    sync_s = time.perf_counter() - t0
    trainer.cfg.checkpoint.save = os.path.join(root, "async")
    start = saver.boundary(step, due=True)
    blocking, write_start, steps, step_times, published = start.blocking_s, time.perf_counter(), 0, [], None
    while published is None:
        t1 = time.perf_counter()
        trainer.train_one(step)
        step_times.append(time.perf_counter() - t1)
        step, steps = step + 1, steps + 1
        b = saver.boundary(step, due=False)
        blocking += b.blocking_s
        published = b.published
    write_s = time.perf_counter() - write_start
    same = _hashes(sync_dir) == _hashes(published)
    alone = []
    for _ in range(max(2, min(steps, 5))):  # steps with no write in flight, for comparison
        t1 = time.perf_counter()
        trainer.train_one(step)
        alone.append(time.perf_counter() - t1)
        step += 1
    state = sum(os.path.getsize(os.path.join(sync_dir, f)) for f in os.listdir(sync_dir)
                if f.endswith(".safetensors"))
    for sub in ("sync", "async"):
        shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    return {"state_bytes": state, "sync_s": sync_s, "async_s": blocking, "start_s": start.blocking_s,
            "write_s": write_s, "steps": steps, "step_during_s": statistics.mean(step_times),
            "step_alone_s": statistics.mean(alone), "identical": same}, step


def run_size(target: int, repeats: int, workdir: str) -> dict:
    hidden, layers = model_shape(target)
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=workdir)
    trainer = build(hidden, layers, root)
    try:
        trainer.train_one(0)  # AdamW moments exist from the first step on
        trainer.cfg.checkpoint.async_save = True
        saver = Checkpointer(trainer)  # one per run, as in training: its host buffers are reused
        step, runs = 1, []
        for _ in range(repeats):
            figures, step = measure(trainer, saver, root, step)
            runs.append(figures)
    finally:
        trainer.close()
        shutil.rmtree(root, ignore_errors=True)
    later = runs[1:] or runs  # the first async save allocates the host buffers
    med = {k: statistics.median(r[k] for r in later) for k in runs[0] if k != "identical"}
    med["sync_s"] = statistics.median(r["sync_s"] for r in runs)
    return {**med, "hidden": hidden, "layers": layers, "identical": all(r["identical"] for r in runs),
            "first_async_s": runs[0]["async_s"], "ratios": [r["async_s"] / r["sync_s"] for r in runs]}


def table(rows: list[dict]) -> str:
    lines = ["| state | model (h x layers) | sync save (s) | async blocking (s) | at the start: "
             "host copy (s) | async / sync | first async save (s) | background write (s) | steps "
             "meanwhile | step time during / without write | files identical |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['state_bytes'] / 1e6:,.0f} MB | {r['hidden']} x {r['layers']} | "
                     f"{r['sync_s']:.3f} | {r['async_s']:.3f} | {r['start_s']:.3f} | "
                     f"{100 * r['async_s'] / r['sync_s']:.1f}% | {r['first_async_s']:.3f} | "
                     f"{r['write_s']:.2f} | {r['steps']:.0f} | "
                     f"{r['step_during_s']:.3f} / {r['step_alone_s']:.3f} s | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10MB,100MB,1GB", help="checkpointed state per run, e.g. 10MB,1GB")
    ap.add_argument("--repeats", type=int, default=4, help="saves of each kind per size")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    args = ap.parse_args(argv)
    at_least(ap, args, repeats=1)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        ap.error(f"--sizes: {exc}")
    if not sizes or any(size < 1 for size in sizes):
        ap.error(f"--sizes takes sizes above 0 such as 10MB,1GB, got {args.sizes!r}")
    workdir = args.dir or tempfile.gettempdir()
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for size in sizes:
        rows.append(run_size(size, args.repeats, workdir))
        r = rows[-1]
        print(f"{r['state_bytes'] / 1e6:,.0f} MB: sync {r['sync_s']:.3f} s, async blocking "
              f"{r['async_s']:.3f} s (per repeat: {', '.join(f'{100 * x:.1f}%' for x in r['ratios'])})",
              flush=True)
    print()
    print(table(rows))
    last = rows[-1]
    ratio = last["async_s"] / last["sync_s"]
    print(f"\nlargest size ({last['state_bytes'] / 1e6:,.0f} MB): async blocking {100 * ratio:.1f}% of "
          f"the synchronous save (target <= 20%: {'met' if ratio <= 0.2 else 'NOT met'}); "
          f"{torch.get_num_threads()} threads, checkpoints under {workdir}")
    return rows


if __name__ == "__main__":
    main()
