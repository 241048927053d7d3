"""The device check's TP-overlap stage: on a machine with two devices, the same tp=2 run with
sequence parallelism without and with ``--tp-comm-overlap`` (one process per device, torchrun),
tokens/s and the exposed TP time of each, and their ratio. With one device there is no pair to
overlap over: the stage is skipped and the chunked-GEMM table (benchmarks/device_check/gemm_chunks.py)
shows the decomposition's own cost instead. On the CPU (``--allow-cpu``) the two ranks are gloo
processes, which exercises the stage end to end.

Figures are the runs' own summaries (engine/observe/metrics.py ``summarize_run``: tokens over
seconds after the warm-up, ``time_tp_exposed_s`` per step). Both runs train the same model on the
same samples, so their per-step losses are compared too: the largest relative difference over the
steps, and the stage fails when it is above ``rel_tol`` (the overlapped GEMMs sum in another
order, so bf16 differs in its last bits; fp32 agrees to docs/design.md's 1e-4).
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


def run_tp_overlap(deadline_s: float, out: Path, kind: str, argv_for, run_process, warmup: int,
                   rel_tol: float = 2e-2) -> dict:
    """Both variants within ``deadline_s`` (half each). ``argv_for(name, flags)``: engine.train's
    flags for one variant; ``run_process(cmd, log, deadline)``: (exit code or None, wall s).
    Returns {"status", "detail", "rows", "wall_s"}; rows: {"run", "tokens_per_s",
    "time_tp_exposed_s", "steps", "losses"}, and when both finished "ratio" (overlap over plain
    tokens/s) and "loss_rel_diff" (the largest relative difference of their per-step losses;
    status "failed" above ``rel_tol``)."""
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
                     "time_tp_exposed_s": s["time_tp_exposed_s"], "steps": s["steps"],
                     "losses": [r["loss"] for r in records]})
    plain, overlap = (r["tokens_per_s"] for r in rows)
    diff = loss_rel_diff(rows[0]["losses"], rows[1]["losses"])
    bad = diff is None or diff > rel_tol
    return {"status": "failed" if bad else "ok",
            "detail": (f"losses differ: {_diff_text(diff)} > {rel_tol:g}" if bad else ""),
            "rows": rows, "wall_s": wall, "ratio": overlap / plain if plain and overlap else None,
            "loss_rel_diff": diff}


def loss_rel_diff(a: list, b: list) -> float | None:
    """The largest |a_i - b_i| / |a_i| over the steps both ran (None: no common step).

    >>> round(loss_rel_diff([2.0, 4.0], [2.0, 4.4, 9.0]), 12)
    0.1
    """
    pairs = list(zip(a, b))
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs)


def _diff_text(diff) -> str:
    return "no common step" if diff is None else f"{diff:.2e}"


def tp_overlap_flags(flags=()) -> tuple[str, ...]:
    """The layout both variants share, plus a variant's own flags."""
    return ("--tp", str(TP), "--sequence-parallel", *flags)
