"""The device check's TP-overlap stage: on a machine with two devices, the same tp=2 run with
sequence parallelism without and with ``--tp-comm-overlap`` (one process per device, torchrun),
tokens/s and the exposed TP time of each, and their ratio. With one device there is no pair to
overlap over: the stage is skipped and the chunked-GEMM table (benchmarks/device_gemm_chunks.py)
shows the decomposition's own cost instead. On the CPU (``--allow-cpu``) the two ranks are gloo
processes, which exercises the stage end to end.

Figures are the runs' own summaries (engine/observe/metrics.py ``summarize_run``: tokens over
seconds after the warm-up, ``time_tp_exposed_s`` per step).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.common import read_jsonl
from engine.observe.metrics import summarize_run

TP = 2
VARIANTS = (("plain", ()), ("overlap", ("--tp-comm-overlap",)))


def device_count(kind: str) -> int:
    """Devices this process sees (CPU: any number of gloo processes; 2 is what the stage needs)."""
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return torch.npu.device_count()
    return TP


def run_tp_overlap(deadline_s: float, out: Path, kind: str, argv_for, run_process, warmup: int) -> dict:
    """Both variants within ``deadline_s`` (half each). ``argv_for(name, flags)``: engine.train's
    flags for one variant; ``run_process(cmd, log, deadline)``: (exit code or None, wall s).
    Returns {"status", "detail", "rows", "wall_s"}; rows: {"run", "tokens_per_s",
    "time_tp_exposed_s", "steps"}, and "ratio" (overlap over plain tokens/s) when both finished."""
    if device_count(kind) < TP:
        return {"status": "skipped", "detail": f"one {kind} device: no pair to overlap over (the "
                f"chunked-GEMM table shows the decomposition's cost)", "rows": [], "wall_s": None}
    rows, wall = [], 0.0
    for name, flags in VARIANTS:
        metrics = out / f"tp_overlap_{name}.jsonl"
        metrics.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(TP), "-m", "engine.train", *argv_for(name, str(metrics), flags)]
        code, seconds = run_process(cmd, out / f"tp_overlap_{name}.log", deadline_s / len(VARIANTS))
        wall += seconds
        records = read_jsonl(metrics) if metrics.exists() else []
        if code != 0 or len(records) < 2:
            what = "stopped at its deadline" if code is None else f"exit {code}"
            return {"status": "deadline" if code is None else "failed",
                    "detail": f"{name}: {what} after {len(records)} steps", "rows": rows, "wall_s": wall}
        s = summarize_run(records, min(warmup, len(records) - 1))
        rows.append({"run": name, "tokens_per_s": s["tokens_per_s"],
                     "time_tp_exposed_s": s["time_tp_exposed_s"], "steps": s["steps"]})
    plain, overlap = (r["tokens_per_s"] for r in rows)
    return {"status": "ok", "detail": "", "rows": rows, "wall_s": wall,
            "ratio": overlap / plain if plain and overlap else None}


def tp_overlap_flags(flags=()) -> tuple[str, ...]:
    """The layout both variants share, plus a variant's own flags."""
    return ("--tp", str(TP), "--sequence-parallel", *flags)
