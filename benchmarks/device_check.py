"""Accelerator check in one call: ``PYTHONPATH=. python3 -m benchmarks.device_check --out DIR``.

Runs as it is on a CUDA or Ascend NPU machine with any torch from 2.4: no virtual environment, no
pip, no network (``make device-check`` uses the current Python when its torch sees a device). The
plan, each stage a subprocess with its own deadline inside the whole check's budget
(``--budget-s``, default 540 s, so the check ends within 9 minutes: one call of at most 10):

1. ``kernels``: every kernel's device path against its reference (benchmarks/device_kernels.py,
   the grouped GEMM of the MoE experts included);
2. ``eager``: a GPT of about 1.3B parameters (24 layers, hidden 2048, 16 heads, seq 2048, bf16,
   mock data) for ``--steps`` steps: tokens/s, TFLOP/s, MFU, HFU, peak memory and the step's parts
   as totals over the steps after ``--warmup`` (engine.observe.metrics.summarize_run);
3. ``moe`` and ``moe_dense``: an MoE GPT (12 x 1024, 8 experts of 4096, top-2) and the dense GPT of
   its active FLOPs (ffn 8192) the same way, their tokens/s ratio and the planner's prediction
   for both, before and after calibrating it on these two runs (benchmarks/device_moe.py);
4. ``compiled``: the 1.3B GPT with ``--compile`` (compilation falls in the warm-up steps);
5. if time remains, ``fp8``: bf16 against ``--fp8-format hybrid`` on the 1.3B GPT and a hidden-4096
   one, tokens/s and loss over the same steps against issue 36's targets, skipped on a chip
   without FP8 (benchmarks/device_fp8.py); ``syncs``: the host waits per step of a small MoE model counted by the
   engine's dispatch mode and by CUDA's own report, side by side; ``llama``: the 1.3B model with
   llama blocks (RoPE and SwiGLU on their compiled CUDA paths), its MFU against gpt2's;
   ``two_ranks``: two processes
   on the one device (gloo with device tensors,
   which NCCL refuses): dp 2 with ZeRO and the overlapped gather, tp 2 with SP, pp 2 and ep 2,
   each against the serial run in fp32 (benchmarks/device_two_ranks.py); ``tp_overlap`` (two
   devices); ``zero``: the same model with the distributed optimizer (ZeRO-1) on the one device,
   and ``packed``: packed documents (``--reset-attention-mask --reset-position-ids
   --eod-mask-loss``), shorter.

A stage that runs past its deadline is stopped and reported as such in the table, with what it
measured until then; a stage that fails is reported with the last line of its log; neither raises.
Results: ``DIR/device_check.json`` and ``DIR/device_check.md`` (the markdown printed at the end),
with each stage's log beside them. Without an accelerator it says "nothing to check" and exits 0;
``--allow-cpu --tiny`` runs the whole plan on the CPU with a tiny model (how the tests check it);
``--only NAME,...`` runs just those stages of the plan.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import markdown_table, read_jsonl  # noqa: E402
from benchmarks.device_fp8 import fp8_lines, fp8_stage  # noqa: E402
from benchmarks.device_moe import comparison_lines, stage_model, syncs_lines, syncs_stage  # noqa: E402
from engine.device.runtime import detect_device_type, setup_device  # noqa: E402
from engine.observe.metrics import summarize_run  # noqa: E402

MODEL = {"num-layers": 24, "hidden-size": 2048, "num-attention-heads": 16, "seq-length": 2048,
         "vocab-size": 51200}
TINY = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
        "vocab-size": 256}
RESERVE_S = 15.0   # kept back from the budget for writing the report
MIN_STAGE_S = 20.0  # a stage that would get less than this is skipped


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float                 # its own deadline at most
    optional: bool = False       # run only while time remains
    flags: tuple[str, ...] = ()  # extra engine.train flags (training stages)
    steps: int | None = None     # at most --steps (None: --steps)

    @property
    def training(self) -> bool:
        return self.name not in ("kernels", "tp_overlap", "two_ranks", "syncs", "fp8")


@dataclass
class StageResult:
    name: str
    status: str                  # ok | failed | deadline | skipped
    deadline_s: float | None
    wall_s: float | None
    detail: str = ""
    kernels: list = field(default_factory=list)
    summary: dict | None = None
    gemm_chunks: list = field(default_factory=list)   # the TP overlap's chunked GEMM on one device
    tp_overlap: dict | None = None  # tp=2 without / with --tp-comm-overlap on two devices
    two_ranks: dict | None = None   # two processes on one device (gloo) against the serial run
    syncs: list = field(default_factory=list)  # host waits: the dispatch mode's and CUDA's count
    fp8: dict | None = None         # bf16 against FP8 per model (benchmarks/device_fp8.py)


def plan(skip_compile: bool = False) -> list[Stage]:
    """The stages in order. Caps are sized for a 1.3B model on one H100/H200-class device: 20
    eager steps take about a minute, inductor's first compile two to three."""
    stages = [Stage("kernels", 90.0), Stage("eager", 180.0), Stage("moe", 90.0),
              Stage("moe_dense", 75.0)]
    if not skip_compile:
        stages.append(Stage("compiled", 240.0, flags=("--compile",)))
    stages += [Stage("fp8", 300.0, optional=True, steps=10), Stage("syncs", 90.0, optional=True),
               Stage("llama", 150.0, optional=True, flags=("--block", "llama"), steps=10),
               Stage("two_ranks", 150.0, optional=True, steps=6),
               Stage("tp_overlap", 150.0, optional=True, steps=10),
               Stage("zero", 120.0, optional=True, flags=("--use-distributed-optimizer",), steps=10),
               Stage("packed", 120.0, optional=True, steps=10,
                     flags=("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"))]
    return stages


def deadline_for(stage: Stage, remaining_s: float) -> float | None:
    """The stage's deadline given the budget left, or None when it gets no run (too little time).

    >>> deadline_for(Stage("eager", 180.0), 500.0), deadline_for(Stage("eager", 180.0), 100.0)
    (180.0, 85.0)
    >>> deadline_for(Stage("zero", 120.0, optional=True), 30.0) is None
    True
    """
    left = remaining_s - RESERVE_S
    if left < MIN_STAGE_S:
        return None
    return min(stage.cap_s, left)


def train_argv(kind: str, steps: int, metrics: str, run_dir: str, flags=(), micro_batch: int = 4,
               global_batch: int = 16, model: dict | None = None, precision: str = "bf16") -> list[str]:
    """engine.train's flags for a stage: mock data, no checkpoint, no plot (matplotlib is not
    needed), metrics to ``metrics``."""
    argv = ["--mock-data", "--device", kind, "--precision", precision, "--no-progress",
            "--train-iters", str(steps), "--lr-warmup-iters", "2", "--log-interval", "1",
            "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
            "--metrics-file", metrics, "--run-dir", run_dir, "--save", "", "--plot", ""]
    for key, value in (model or MODEL).items():
        argv += [f"--{key}", str(value)]
    return argv + list(flags)


def _run_process(cmd: list[str], log_path: Path, deadline_s: float) -> tuple[int | None, float]:
    """(exit code or None when stopped at the deadline, wall seconds); the whole process group
    is stopped at the deadline."""
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.monotonic() - start


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"


def _tp_overlap_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    from benchmarks.device_tp_overlap import run_tp_overlap, tp_overlap_flags
    steps = min(stage.steps or args.steps, args.steps)
    model, precision = (TINY, "fp32") if args.tiny else (MODEL, "bf16")

    def argv_for(name: str, metrics: str, flags) -> list[str]:
        return train_argv(kind, steps, metrics, str(out / f"tp_overlap_{name}"), tp_overlap_flags(flags),
                          args.micro_batch_size, args.global_batch_size, model, precision)
    got = run_tp_overlap(deadline_s, out, kind, argv_for, _run_process, args.warmup,
                         rel_tol=1e-4 if precision == "fp32" else 2e-2)
    return StageResult(stage.name, got["status"], deadline_s, got["wall_s"], got["detail"],
                       tp_overlap=got)


TWO_RANKS_MODEL = {"num-layers": 4, "hidden-size": 256, "num-attention-heads": 4,
                   "seq-length": 256, "vocab-size": 1024}


def _two_ranks_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    from benchmarks.device_two_ranks import run_two_ranks
    if kind == "cpu":
        return StageResult(stage.name, "skipped", deadline_s, None, "on the CPU the test suite "
                           "trains every layout against the serial run")
    steps = min(stage.steps or args.steps, args.steps)
    model = TINY if args.tiny else TWO_RANKS_MODEL

    def argv_for(metrics: str, flags) -> list[str]:   # fp32: the layouts equal the serial run
        return train_argv(kind, steps, metrics, str(out / "two_ranks"), flags, 2, 8, model, "fp32")
    got = run_two_ranks(deadline_s, out, kind, argv_for, _run_process)
    return StageResult(stage.name, got["status"], deadline_s, got["wall_s"], got["detail"],
                       two_ranks=got)


def run_stage(stage: Stage, deadline_s: float, out: Path, kind: str, args) -> StageResult:
    log = out / f"{stage.name}.log"
    if stage.name == "syncs":  # benchmarks/device_moe.py
        return syncs_stage(stage, deadline_s, out, kind, args)
    if stage.name == "tp_overlap":
        return _tp_overlap_stage(stage, deadline_s, out, kind, args)
    if stage.name == "two_ranks":
        return _two_ranks_stage(stage, deadline_s, out, kind, args)
    if stage.name == "fp8":
        return fp8_stage(stage, deadline_s, out, kind, args)
    if not stage.training:
        data = out / "kernels.json"
        data.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.device_check", "--stage", "kernels",
               "--out", str(out), "--device", kind] + (["--tiny"] if args.tiny else [])
        code, wall = _run_process(cmd, log, deadline_s)
        rows = json.loads(data.read_text()) if code == 0 and data.exists() else []
        chunks = out / "gemm_chunks.json"
        gemm = json.loads(chunks.read_text()) if code == 0 and chunks.exists() else []
        status = "ok" if code == 0 and rows and all(r["ok"] for r in rows) else \
            "deadline" if code is None else "failed"
        detail = "" if status == "ok" else \
            f"stopped at its {deadline_s:g} s deadline" if code is None else \
            ("outside tolerance: " + ", ".join(r["op"] for r in rows if not r["ok"]) if code == 0
             else f"exit {code}: {_last_line(log)}")
        return StageResult(stage.name, status, deadline_s, wall, detail, kernels=rows,
                           gemm_chunks=gemm)
    metrics = out / f"{stage.name}.jsonl"
    metrics.unlink(missing_ok=True)
    steps = min(stage.steps or args.steps, args.steps)
    model, precision = (TINY, "fp32") if args.tiny else (MODEL, "bf16")
    model = stage_model(stage.name, args.tiny) or model   # the MoE stages' own models
    cmd = [sys.executable, "-m", "engine.train",
           *train_argv(kind, steps, str(metrics), str(out / stage.name), stage.flags,
                       args.micro_batch_size, args.global_batch_size, model, precision)]
    code, wall = _run_process(cmd, log, deadline_s)
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
    return StageResult(stage.name, "failed", deadline_s, wall, f"exit {code}: {_last_line(log)}",
                       summary=summary)


def run_plan(stages: list[Stage], out: Path, kind: str, args, clock=time.monotonic) -> list[StageResult]:
    """Every stage in order within the budget; optional ones only while time remains."""
    end = clock() + args.budget_s
    results = []
    for stage in stages:
        deadline = deadline_for(stage, end - clock())
        if deadline is None:
            results.append(StageResult(stage.name, "skipped", None, None,
                                       "no time left in the budget"))
            continue
        print(f"device_check: {stage.name} (deadline {deadline:.0f} s)", flush=True)
        results.append(run_stage(stage, deadline, out, kind, args))
    return results


# ---- report ----------------------------------------------------------------------------------

def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def _num(v, spec):
    return "-" if v is None else format(v, spec)


def report(results: list[StageResult], header: dict) -> str:
    lines = [f"device_check: {header['device']} ({header['device_name']}), torch {header['torch']}, "
             f"Python {header['python']}; budget {header['budget_s']:.0f} s, took "
             f"{header['wall_s']:.0f} s", ""]
    stage_rows = [[r.name, r.status, _num(r.deadline_s, ".0f"), _num(r.wall_s, ".0f"), r.detail or "-"]
                  for r in results]
    lines += [markdown_table(["stage", "status", "deadline (s)", "wall (s)", "detail"], stage_rows), ""]
    kern = next((r for r in results if r.kernels), None)
    if kern:
        lines += [markdown_table(["op", "device path", "forward err", "gradient err", "within tolerance"],
                                 [[k["op"], k["path"], f"{k['forward']:.2e}", f"{k['gradient']:.2e}",
                                   "yes" if k["ok"] else "NO"] for k in kern.kernels]),
                  "", "errors: max |device - reference| / max(1, max |reference|)", ""]
    if kern and kern.gemm_chunks:
        lines += [markdown_table(["tp chunks", "plain GEMM (ms)", "chunked GEMMs (ms)", "ratio",
                                  "max err"],
                                 [[str(g["tp"]), f"{g['plain_ms']:.3f}", f"{g['chunked_ms']:.3f}",
                                   f"{g['ratio']:.3f}", f"{g['max_err']:.1e}"] for g in kern.gemm_chunks]),
                  "", "--tp-comm-overlap's decomposition on one device: one TP rank's column GEMM "
                      "cut into tp sequence chunks against the plain GEMM (device time, median)", ""]
    two = next((r.two_ranks for r in results if r.two_ranks and r.two_ranks.get("rows")), None)
    if two:
        lines += [markdown_table(["two processes, one device (gloo)", "status",
                                  "largest relative loss difference vs serial", "note"],
                                 [[row["layout"], row["status"], _num(row["loss_rel_diff"], ".1e"),
                                   row["note"]] for row in two["rows"]]),
                  "", "Each layout trained as two processes on the one device against the serial "
                      "run on it (fp32, DESIGN.md's 1e-4); a layout gloo cannot run says which "
                      "collective it refused.", ""]
    pair = next((r.tp_overlap for r in results if r.tp_overlap and r.tp_overlap.get("rows")), None)
    if pair:
        lines += [markdown_table(["tp=2 with SP", "tokens/s", "exposed TP (s per step)"],
                                 [[row["run"], _num(row["tokens_per_s"], ".0f"),
                                   _num(row["time_tp_exposed_s"], ".4f")] for row in pair["rows"]]),
                  "", f"--tp-comm-overlap on one device pair: overlap / plain tokens/s = "
                      f"{_num(pair.get('ratio'), '.3f')}; largest relative loss difference over "
                      f"the steps {_num(pair.get('loss_rel_diff'), '.1e')}", ""]
    runs = [r for r in results if r.summary]
    if runs:
        lines.append(markdown_table(
            ["run", "steps timed", "tokens/s", "TFLOP/s per device (model)", "MFU", "HFU",
             "step time (s)", "fwd+bwd / DP finish / optimizer (s)", "host syncs per step",
             "peak memory (GiB)"],
            [[r.name, str(r.summary["steps"]), _num(r.summary["tokens_per_s"], ".0f"),
              _num(r.summary["model_tflops_per_device"], ".1f"), _pct(r.summary["mfu"]),
              _pct(r.summary["hfu"]), _num(r.summary["step_time_s"], ".3f"),
              " / ".join(_num(r.summary[k], ".3f") for k in
                         ("time_forward_backward_s", "time_dp_finish_s", "time_optimizer_s")),
              _num(r.summary.get("host_syncs_per_step"), "d"),
              _num((r.summary["peak_memory_bytes"] or 0) / 2**30, ".1f")] for r in runs]))
        lines += ["", f"model: {header['model']} (moe, moe_dense: benchmarks/device_moe.py); totals "
                      f"over the steps after the warm-up ({header['warmup']} steps left out); MFU "
                      f"against the dense peak of engine/plan/hardware.py.", ""]
        lines += comparison_lines(results, header, Path(header.get("out", ".")),
                                  header.get("tiny", False), header.get("micro_batch", 4),
                                  header.get("global_batch", 16))
    lines += fp8_lines(results) + syncs_lines(next((r.syncs for r in results if r.syncs), []))
    return "\n".join(lines)


def _kernels_stage(args) -> int:
    from benchmarks.device_kernels import check_kernels
    dev = setup_device(args.device, 0)
    dtype, seq = (torch.float32, 64) if args.tiny else (torch.bfloat16, 512)
    rows = check_kernels(dev.device, dtype, seq)
    (Path(args.out) / "kernels.json").write_text(json.dumps(rows, indent=1))
    from benchmarks.device_gemm_chunks import time_chunked_gemm
    shape = dict(tokens=256, hidden=64, ffn=256, repeats=3) if args.tiny else {}
    (Path(args.out) / "gemm_chunks.json").write_text(
        json.dumps(time_chunked_gemm(dev.device, dtype, **shape), indent=1))
    return 0


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
              "model": ", ".join(f"{k} {v}" for k, v in (TINY if args.tiny else MODEL).items())
              + (", fp32" if args.tiny else ", bf16")
              + f", micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}",
              "out": str(out), "tiny": args.tiny, "micro_batch": args.micro_batch_size,
              "global_batch": args.global_batch_size}
    results = run_plan([s for s in plan(args.skip_compile) if s.name in only], out, kind, args)
    header["wall_s"] = time.monotonic() - start
    text = report(results, header)
    (out / "device_check.json").write_text(json.dumps(
        {**header, "stages": [asdict(r) for r in results]}, indent=1))
    (out / "device_check.md").write_text(text + "\n")
    print(text)
    print(f"\ndevice_check: wrote {out / 'device_check.json'} and {out / 'device_check.md'}")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
