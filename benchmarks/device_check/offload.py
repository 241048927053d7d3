"""The device check's optimizer-offload stage: issue 37's target on one device.

A GPT too large to train on one H200 without the offload, Llama-3-8B's shape (32 layers x 4096,
32 heads in 8 query groups, SwiGLU 14336, vocabulary 128256, seq 2048, bf16; the 8B of
docs/benchmarks.md, "One H200 with the optimizer offloaded"), trained with the distributed
optimizer and ``--optimizer-cpu-offload``, micro-batch 2, global batch 16, mock data,
``OFFLOAD_STEPS`` steps. The offload fraction is the largest that the engine's own memory check
(engine/training/memory_check.py, the planner's engine/plan/offload.py ``fraction_within``) fits
in the host memory available at the stage's start, less ``HOST_MARGIN`` for the run's process
itself, and in the device's free memory (``offload_fraction``); where none fits, the stage is
skipped with the check's line. Reported: tokens/s, MFU, peak device memory (the run's summary
over the steps after the first) and the host update's share of the step, ``time_optimizer_s``
over ``step_time_s`` (the host's AdamW and the weights' copies up, docs/benchmarks.md).

The stage is the plan's last and is started only with 300 s or more left (plan.py
``OFFLOAD_MIN_S``: the 8B's weights are drawn on the host and about 100 GiB of host memory is
pinned before the first step), so the default budget does not reach it: ``--only offload``
runs it alone, in one call. ``--tiny`` trains the tiny model with half its optimizer offloaded,
on the CPU (how the tests exercise the stage).
"""
from __future__ import annotations

import sys
from pathlib import Path

GIB = 2 ** 30
MODEL_8B = {"block": "llama", "num-layers": 32, "hidden-size": 4096, "num-attention-heads": 32,
            "num-query-groups": 8, "ffn-hidden-size": 14336, "vocab-size": 128256,
            "seq-length": 2048}
OFFLOAD_FLAGS = ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--recompute", "none",
                 "--dropout", "0")
MICRO_BATCH, GLOBAL_BATCH = 2, 16
OFFLOAD_STEPS = 4
OFFLOAD_WARMUP = 1       # the first step (allocations, the first host update) left out
HOST_MARGIN = 8 * GIB    # kept back from the host's free memory: the run's own process, its libraries
TINY_FRACTION = 0.5      # --tiny on the CPU (one memory: the fraction frees nothing, it runs the path)


def offload_argv(kind: str, metrics: str, run_dir: str, fraction: float, tiny: bool = False,
                 steps: int = OFFLOAD_STEPS) -> list[str]:
    """engine.train's flags for the stage's run."""
    from benchmarks.device_check.plan import TINY, train_argv
    model = TINY if tiny else MODEL_8B
    return train_argv(kind, steps, metrics, run_dir,
                      (*OFFLOAD_FLAGS, "--optimizer-offload-fraction", f"{fraction:g}"),
                      2 if tiny else MICRO_BATCH, 4 if tiny else GLOBAL_BATCH, model,
                      "fp32" if tiny else "bf16")


def offload_fraction(kind: str, device_free: tuple[int | None, str],
                     host_free: tuple[int | None, str]) -> tuple[float | None, str]:
    """(the largest offload fraction, in steps of 0.05, whose host part fits ``host_free`` less
    ``HOST_MARGIN`` and whose device part fits ``device_free``, by the engine's memory check;
    "") or (None, the check's line for the largest fraction the host holds, or at 1 where the
    host holds none)."""
    from engine.config.cli import parse_args
    from engine.device.runtime import BACKENDS
    from engine.plan.memory import stage_param_split
    from engine.plan.offload import fraction_within, host_memory
    from engine.training.memory_check import memory_problem, planner_inputs

    def config(fraction: float):
        return parse_args(offload_argv(kind, "m.jsonl", "run", fraction))
    cfg = config(1.0)
    grid = cfg.parallel.grid(1)
    shape, layout = planner_inputs(cfg, grid)
    at_full = host_memory(shape, layout, *stage_param_split(shape, layout, 0)).total
    host = (None if host_free[0] is None else host_free[0] - HOST_MARGIN,
            f"{host_free[1]} less {HOST_MARGIN / GIB:g} GiB for the run's process")
    most = 1.0 if host[0] is None else fraction_within(host[0], at_full)
    first = None   # the check's line at the largest fraction the host holds
    for twentieths in range(round(20 * most), 0, -1):
        fraction = twentieths / 20
        problem = memory_problem(config(fraction), grid, 0, *device_free, BACKENDS[kind], host)
        if problem is None:
            return fraction, ""
        first = first or problem
    return None, first or memory_problem(cfg, grid, 0, *device_free, BACKENDS[kind], host) or \
        "no --optimizer-offload-fraction fits the host's memory"


def offload_stage(stage, deadline_s: float, out: Path, kind: str, args):
    """The stage: a StageResult with the run's summary and ``offload`` = {"fraction",
    "host_update_share", "host_memory_available", "device_memory_free"}."""
    from benchmarks.common import read_jsonl
    from benchmarks.device_check.launch import launcher
    from benchmarks.device_check.plan import StageResult, last_line
    from engine.device.runtime import available_memory
    from engine.observe.metrics import summarize_run
    host = available_memory("cpu")
    device = available_memory(kind) if kind != "cpu" else (None, "")
    if args.tiny:
        fraction, why = TINY_FRACTION, ""
    else:
        fraction, why = offload_fraction(kind, device, host)
    info = {"fraction": fraction, "host_update_share": None, "host_memory_available": host[0],
            "device_memory_free": device[0]}
    if fraction is None:
        return StageResult(stage.name, "skipped", deadline_s, None, why, offload=info)
    steps = min(OFFLOAD_STEPS, args.steps)
    metrics, log = out / "offload.jsonl", out / "offload.log"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "engine.train",
           *offload_argv(kind, str(metrics), str(out / "offload"), fraction, args.tiny, steps)]
    code, wall = launcher(kind)(cmd, log, deadline_s)
    records = read_jsonl(metrics) if metrics.exists() else []
    summary = summarize_run(records, min(OFFLOAD_WARMUP, len(records) - 1)) if records else None
    if summary and summary["time_optimizer_s"] is not None and summary["step_time_s"]:
        info["host_update_share"] = summary["time_optimizer_s"] / summary["step_time_s"]
    if code == 0:
        return StageResult(stage.name, "ok", deadline_s, wall, summary=summary, offload=info)
    detail = (f"stopped at its {deadline_s:g} s deadline after {len(records)} of {steps} steps"
              if code is None else f"exit {code}: {last_line(log)}")
    return StageResult(stage.name, "deadline" if code is None else "failed", deadline_s, wall,
                       detail, summary=summary, offload=info)


def offload_lines(results) -> list[str]:
    """The stage's line (none when it did not run)."""
    got = next((r for r in results if getattr(r, "offload", None)), None)
    if got is None or got.offload["fraction"] is None:
        return []
    info, s = got.offload, got.summary or {}
    num = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    share = info["host_update_share"]
    gib = lambda n: None if n is None else n / GIB  # noqa: E731
    finished = "" if got.status == "ok" else f" ({got.status}: from the steps it made)"
    return [f"optimizer offload{finished}, over the steps after the first: "
            f"--optimizer-offload-fraction {info['fraction']:g} "
            f"(host memory available {num(gib(info['host_memory_available']), '.1f')} GiB, device "
            f"free {num(gib(info['device_memory_free']), '.1f')} GiB at the stage's start): "
            f"{num(s.get('tokens_per_s'), '.0f')} tokens/s, MFU "
            f"{num(None if s.get('mfu') is None else 100 * s['mfu'], '.1f')}%, peak memory "
            f"{num(gib(s.get('peak_memory_bytes')), '.1f')} GiB, the host update "
            f"{num(s.get('time_optimizer_s'), '.2f')} s of a {num(s.get('step_time_s'), '.2f')} s "
            f"step ({num(None if share is None else 100 * share, '.1f')}%)", ""]
