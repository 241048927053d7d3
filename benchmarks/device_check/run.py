"""Accelerator check in one call: ``PYTHONPATH=. python3 -m benchmarks.device_check --out DIR``.

Runs as it is on a CUDA or Ascend NPU machine with any torch from 2.4: no virtual environment, no
pip, no network (``make device-check`` uses the current Python when its torch sees a device). The
plan, each stage a subprocess with its own deadline inside the whole check's budget
(``--budget-s``, default 540 s, so the check ends within 9 minutes: one call of at most 10):

1. ``kernels``: every kernel's device path against its reference
   (benchmarks/device_check/kernels.py, the grouped GEMM of the MoE experts included);
2. ``eager``: a GPT of about 1.3B parameters (24 layers, hidden 2048, 16 heads, seq 2048, bf16,
   mock data) for ``--steps`` steps: tokens/s, TFLOP/s, MFU, HFU, peak memory and the step's parts
   as totals over the steps after ``--warmup`` (engine.observe.metrics.summarize_run);
3. ``moe`` and ``moe_dense``: an MoE GPT (12 x 1024, 8 experts of 4096, top-2) and the dense GPT of
   its active FLOPs (ffn 8192) the same way, their tokens/s ratio and the planner's prediction
   for both, before and after calibrating it on these two runs (benchmarks/device_check/moe.py);
4. while time remains, the figures no device has measured yet, those with targets first:
   ``fp8``, bf16 against ``--fp8-format hybrid`` on the 1.3B GPT and a hidden-4096 one, tokens/s
   and loss over the same steps against issue 36's targets, skipped on a chip without FP8
   (benchmarks/device_check/fp8.py); ``two_ranks``, two processes on the one device (gloo with
   device tensors, which NCCL refuses, probed first as one command under its own deadline): dp 2
   with ZeRO and the overlapped gather, tp 2 with SP, pp 2 and ep 2, each against the serial run
   in fp32 (benchmarks/device_check/two_ranks.py); ``syncs``, the host waits per step of a small
   MoE model counted by the engine's dispatch mode and by CUDA's own report, side by side;
   ``llama``, the 1.3B model with llama blocks (RoPE and SwiGLU on their compiled CUDA paths),
   its MFU against gpt2's;
5. then, while time remains: ``compiled``, the 1.3B GPT with ``--compile`` (compilation falls in
   the warm-up steps); ``tp_overlap`` (two devices); ``zero``, the same model with the distributed
   optimizer (ZeRO-1) on the one device; ``packed``, packed documents
   (``--reset-attention-mask --reset-position-ids --eod-mask-loss``), shorter;
6. ``offload``: an 8B llama with its optimizer offloaded to host memory (issue 37: tokens/s, MFU,
   peak memory, the host update's share of the step; benchmarks/device_check/offload.py). It
   starts only with 300 s left, which the default budget never leaves after the stages above:
   ``--only offload`` runs it alone, in one call.

A stage that runs past its deadline is stopped and reported as such in the table, with what it
measured until then; a stage that fails is reported with the last line of its log; neither raises,
and an exception in the check's own process fails only its stage (``guarded_stage``). The report
is rewritten after every stage.
Results: ``DIR/device_check.json`` and ``DIR/device_check.md`` (the markdown printed at the end),
with each stage's log beside them. Without an accelerator it says "nothing to check" and exits 0;
``--allow-cpu --tiny`` runs the whole plan on the CPU with a tiny model (how the tests check it);
``--only NAME,...`` runs just those stages of the plan.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import read_jsonl
from benchmarks.device_check.fp8 import fp8_stage
from benchmarks.device_check.moe import stage_model, syncs_stage
from benchmarks.device_check.launch import launcher
from benchmarks.device_check.offload import offload_stage
from benchmarks.device_check.plan import (MODEL, TINY, TWO_RANKS_MODEL, Stage, StageResult,
                                          deadline_for, last_line, plan, train_argv)
from benchmarks.device_check.report import report
from engine.device.runtime import available_memory, detect_device_type, setup_device
from engine.observe.metrics import summarize_run


def _tp_overlap_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    from benchmarks.device_check.tp_overlap import run_tp_overlap, tp_overlap_flags
    steps = min(stage.steps or args.steps, args.steps)
    model, precision = (TINY, "fp32") if args.tiny else (MODEL, "bf16")

    def argv_for(name: str, metrics: str, flags) -> list[str]:
        return train_argv(kind, steps, metrics, str(out / f"tp_overlap_{name}"), tp_overlap_flags(flags),
                          args.micro_batch_size, args.global_batch_size, model, precision)
    got = run_tp_overlap(deadline_s, out, kind, argv_for, launcher(kind), args.warmup,
                         rel_tol=1e-4 if precision == "fp32" else 2e-2)
    return StageResult(stage.name, got["status"], deadline_s, got["wall_s"], got["detail"],
                       tp_overlap=got)


def _two_ranks_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    from benchmarks.device_check.two_ranks import run_two_ranks
    if kind == "cpu":
        return StageResult(stage.name, "skipped", deadline_s, None, "on the CPU the test suite "
                           "trains every layout against the serial run")
    steps = min(stage.steps or args.steps, args.steps)
    model = TINY if args.tiny else TWO_RANKS_MODEL

    def argv_for(metrics: str, flags) -> list[str]:   # fp32: the layouts equal the serial run
        return train_argv(kind, steps, metrics, str(out / "two_ranks"), flags, 2, 8, model, "fp32")
    got = run_two_ranks(deadline_s, out, kind, argv_for, launcher(kind))
    return StageResult(stage.name, got["status"], deadline_s, got["wall_s"], got["detail"],
                       two_ranks=got)


def _kernels_result(stage: Stage, deadline_s: float, out: Path, kind: str, args, log: Path
                    ) -> StageResult:
    """The kernels stage as a subprocess: whatever tables it wrote, and its status (ok only when
    it exited 0 and every case ran within tolerance)."""
    data, chunks = out / "kernels.json", out / "gemm_chunks.json"
    data.unlink(missing_ok=True)
    chunks.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.device_check", "--stage", "kernels",
           "--out", str(out), "--device", kind] + (["--tiny"] if args.tiny else [])
    code, wall = launcher(kind)(cmd, log, deadline_s)
    rows = json.loads(data.read_text()) if data.exists() else []
    gemm = json.loads(chunks.read_text()) if chunks.exists() else []
    bad = [r for r in rows if not r["ok"]]
    status = "ok" if code == 0 and rows and not bad else "deadline" if code is None else "failed"
    parts = [f"stopped at its {deadline_s:g} s deadline"] if code is None else \
        [f"exit {code}: {last_line(log)}"] if code else []
    if bad:
        parts.append("outside tolerance or raised: " + ", ".join(r["op"] for r in bad))
    return StageResult(stage.name, status, deadline_s, wall, "; ".join(parts) if status != "ok" else "",
                       kernels=rows, gemm_chunks=gemm)


def run_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    log = out / f"{stage.name}.log"
    if stage.name == "syncs":  # benchmarks/device_check/moe.py
        return syncs_stage(stage, deadline_s, out, kind, args)
    if stage.name == "tp_overlap":
        return _tp_overlap_stage(stage, deadline_s, out, kind, args)
    if stage.name == "two_ranks":
        return _two_ranks_stage(stage, deadline_s, out, kind, args)
    if stage.name == "fp8":
        return fp8_stage(stage, deadline_s, out, kind, args)
    if stage.name == "offload":
        return offload_stage(stage, deadline_s, out, kind, args)
    if not stage.training:
        return _kernels_result(stage, deadline_s, out, kind, args, log)
    metrics = out / f"{stage.name}.jsonl"
    metrics.unlink(missing_ok=True)
    steps = min(stage.steps or args.steps, args.steps)
    model, precision = (TINY, "fp32") if args.tiny else (MODEL, "bf16")
    model = stage_model(stage.name, args.tiny) or model   # the MoE stages' own models
    cmd = [sys.executable, "-m", "engine.train",
           *train_argv(kind, steps, str(metrics), str(out / stage.name), stage.flags,
                       args.micro_batch_size, args.global_batch_size, model, precision)]
    code, wall = launcher(kind)(cmd, log, deadline_s)
    records = read_jsonl(metrics) if metrics.exists() else []
    warmup = min(args.warmup, len(records) - 1)
    summary = summarize_run(records, warmup) if records else None
    if summary is not None:  # the most host waits any timed step made (engine/device/syncs.py)
        syncs = [r["host_syncs"] for r in records[warmup:] if r.get("host_syncs") is not None]
        summary["host_syncs_per_step"] = max(syncs) if syncs else None
    if code == 0:
        return StageResult(stage.name, "ok", deadline_s, wall, summary=summary)
    if code is None:
        return StageResult(stage.name, "deadline", deadline_s, wall,
                           f"stopped at its {deadline_s:g} s deadline after {len(records)} of "
                           f"{steps} steps", summary=summary)
    return StageResult(stage.name, "failed", deadline_s, wall, f"exit {code}: {last_line(log)}",
                       summary=summary)


def guarded_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    """``run_stage``, whose exception becomes the stage's "failed" row with its last line: one
    stage's crash in the check's own process (a probe, a report of its files) costs that stage,
    not the table of every stage before and after it."""
    start = time.monotonic()
    try:
        return run_stage(stage, deadline_s, out, kind, args)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the plan goes on
        line = (str(exc).strip().splitlines() or [""])[-1][:300]
        return StageResult(stage.name, "failed", deadline_s, time.monotonic() - start,
                           f"{type(exc).__name__} in the check itself: {line}")


def run_plan(stages: list[Stage], out: Path, kind: str, args, clock=time.monotonic,
             on_result=None) -> list[StageResult]:
    """Every stage in order within the budget; optional ones only while time remains.
    ``on_result(results)``: called after each stage with the results so far (the report is
    rewritten then, so a check stopped from outside still leaves the stages it ran)."""
    end = clock() + args.budget_s
    results = []
    for stage in stages:
        deadline = deadline_for(stage, end - clock())
        if deadline is None:
            results.append(StageResult(stage.name, "skipped", None, None,
                                       "no time left in the budget"))
            continue
        print(f"device_check: {stage.name} (deadline {deadline:.0f} s)", flush=True)
        results.append(guarded_stage(stage, deadline, out, kind, args))
        if on_result is not None:
            on_result(results)
    return results


def write_report(out: Path, header: dict, results: list[StageResult], start: float) -> str:
    """device_check.json, then device_check.md, as of now; returns the markdown. The JSON is
    written first and a markdown that fails to render (a figure of an unexpected type) becomes
    a line saying so, so the figures are never lost to their formatting."""
    header["wall_s"] = time.monotonic() - start
    (out / "device_check.json").write_text(json.dumps(
        {**header, "stages": [asdict(r) for r in results]}, indent=1, default=str))
    try:
        text = report(results, header)
    except Exception as exc:  # noqa: BLE001 - the JSON above holds every figure
        text = (f"device_check: the markdown report failed ({type(exc).__name__}: {exc}); "
                f"the figures are in {out / 'device_check.json'}")
    (out / "device_check.md").write_text(text + "\n")
    return text


def _kernels_stage(args) -> int:
    """The kernels stage's process: kernels.json (a row per case, a case that raised included)
    and gemm_chunks.json are both written whatever the other did; exit 1 when either raised."""
    import traceback

    from benchmarks.device_check.gemm_chunks import time_chunked_gemm
    from benchmarks.device_check.kernels import check_kernels
    from engine.device.chips import fp8_problem
    dev = setup_device(args.device, 0)
    fp8 = fp8_problem(dev.type, dev.name, dev.capability) is None   # the chip has FP8 GEMMs
    dtype, seq = (torch.float32, 64) if args.tiny else (torch.bfloat16, 512)
    shape = dict(tokens=256, hidden=64, ffn=256, repeats=3) if args.tiny else {}
    code = 0
    for name, measure in (("kernels.json", lambda: check_kernels(dev.device, dtype, seq, fp8)),
                          ("gemm_chunks.json", lambda: time_chunked_gemm(dev.device, dtype, **shape))):
        try:
            rows = measure()
        except Exception:  # noqa: BLE001 - in the log; the other file is still written
            traceback.print_exc()
            rows, code = [], 1
        (Path(args.out) / name).write_text(json.dumps(rows, indent=1))
    return code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_check",
                                description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", default="runs/device_check", help="where the JSON, markdown and logs go")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole check's deadline")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the totals")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=4, help="lower it on a 40 GB device")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--allow-cpu", action="store_true", help="run the plan on the CPU (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model in fp32 instead of the 1.3B one")
    p.add_argument("--only", help="comma-separated stages of the plan to run (default: all)")
    p.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise", "blockwise"],
                   default="tensorwise", help="the fp8 stage's recipe (tensorwise and rowwise in "
                   "hybrid, blockwise in e4m3): e.g. --only fp8 --fp8-recipe blockwise")
    p.add_argument("--stage", choices=["kernels"], help=argparse.SUPPRESS)
    p.add_argument("--device", default="auto", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stage == "kernels":
        return _kernels_stage(args)
    if args.budget_s <= 0 or args.steps < 2 or not 0 <= args.warmup < args.steps:
        print("device_check: need --budget-s > 0, --steps >= 2 and 0 <= --warmup < --steps", file=sys.stderr)
        return 2
    only = args.only.split(",") if args.only else [s.name for s in plan(args.skip_compile)]
    if set(only) - {s.name for s in plan(args.skip_compile)}:
        print(f"device_check: --only {args.only}: not stages of the plan ({', '.join(s.name for s in plan())})",
              file=sys.stderr)
        return 2
    kind = detect_device_type("auto")
    if kind == "cpu" and not args.allow_cpu:
        print("device_check: no accelerator (CUDA or Ascend NPU) found: nothing to check")
        return 0
    start = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dev = setup_device(kind, 0)
    header = {"device": kind, "device_name": dev.name, "torch": torch.__version__,
              "python": platform.python_version(), "budget_s": args.budget_s, "warmup": args.warmup,
              "host_memory_available": available_memory("cpu")[0],  # what an offload may pin
              "model": ", ".join(f"{k} {v}" for k, v in (TINY if args.tiny else MODEL).items())
              + (", fp32" if args.tiny else ", bf16")
              + f", micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}",
              "out": str(out), "tiny": args.tiny, "micro_batch": args.micro_batch_size,
              "global_batch": args.global_batch_size}
    from engine.plan.hardware import lookup_device, peak_tflops
    header.update(device_table=lookup_device(dev.name),
                  peak_bf16_tflops=peak_tflops(dev.name, "bf16"),
                  peak_fp8_tflops=peak_tflops(dev.name, "fp8"),
                  device_memory_free=available_memory(kind)[0] if kind != "cpu" else None)

    def progress(done: list[StageResult]) -> None:  # a report that fails here is retried at the end
        try:
            write_report(out, header, done, start)
        except Exception as exc:  # noqa: BLE001
            print(f"device_check: the report after {done[-1].name} failed: {exc}", flush=True)
    results = run_plan([s for s in plan(args.skip_compile) if s.name in only], out, kind, args,
                       on_result=progress)
    text = write_report(out, header, results, start)
    print(text)
    print(f"\ndevice_check: wrote {out / 'device_check.json'} and {out / 'device_check.md'}")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
