"""This engine next to the parallelism that ships with PyTorch, on the same GPT, data and seed.

    python -m benchmarks.peers.compare [--layouts 2,1,1 1,2,1 1,1,2 2,2,2] [--steps 10] [--warmup 3]
                               [--repeats 1] [--out runs/peers] [model flags: --num-layers 4 ...]
    python -m benchmarks.peers.compare --layouts 1,2,1 --schedules 1f1b zb-h1 zb-v --repeats 5

For every (tp, pp, dp) layout, two torchrun jobs train the same model for the same steps:
- engine: ``python -m engine.train --mock-data --precision fp32 --device cpu ...`` with the
  layout's flags (the CPU: the native side's device mesh is a CPU one);
- native: ``benchmarks/peers/native.py``, the same GPT-2 built as a plain torch module from the
  engine's serial initial weights, parallelised with DTensor ``parallelize_module``
  (ColwiseParallel/RowwiseParallel), ``torch.distributed.pipelining`` (PipelineStage +
  Schedule1F1B) and DDP; its docstring gives the exact composition and the two places where
  torch 2.13 on gloo needed care (static stage metadata, loss scaling instead of scale_grads).

``--schedules`` adds pipeline schedules to compare (for layouts with pp > 1): the engine's
``--pipeline-schedule`` against torch.distributed.pipelining's own schedule for the same layout:
``Schedule1F1B`` for 1f1b, ``ScheduleInterleavedZeroBubble`` (one stage per rank: its ZB1P, i.e.
ZB-H1) for zb-h1, ``ScheduleZBVZeroBubble`` (two stages per rank in a V, the tied embedding and
output layer on rank 0) for zb-v; the native zero-bubble side runs with tp = dp = 1.

Both sides draw step k's global batch from ``GlobalBatchSampler`` over the engine's mock data with
the same seed, split it into the same micro-batches, and use AdamW with the same decay groups, LR
schedule and global-norm clipping, so their per-step losses must agree (fp32: to ~1e-6 relative;
the check fails above ``--loss-rtol``). Throughput is steady-state tokens/s (the first
``--warmup`` steps dropped; with ``--repeats`` the median over jobs) and the ratio is engine /
native. Jobs alternate which side runs first, so a load change on a shared machine hits both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import (REPO, BenchParser, Layout, at_least, fmt, positive_seconds,  # noqa: E402
                               machine_note, markdown_table, max_rel_diff, parse_layout, steps_past_warmup,
                               read_jsonl, summarize, torchrun)

DEFAULT_LAYOUTS = ("2,1,1", "1,2,1", "1,1,2", "2,2,2")
SPEC = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
        "vocab_size": 512, "micro_batch_size": 2, "global_batch_size": 8, "lr": 1e-3,
        "min_lr": 1e-4, "lr_warmup_iters": 2, "weight_decay": 0.1, "clip_grad": 1.0, "seed": 1234}


def check_layout(layout: Layout, spec: dict, schedule: str = "1f1b") -> None:
    """Refuse a layout the model or batch cannot be split over, before launching anything."""
    per_step = spec["micro_batch_size"] * layout.dp
    problems = []
    if schedule != "1f1b" and (layout.pp == 1 or layout.tp > 1 or layout.dp > 1):
        problems.append(f"--schedules {schedule} is compared on layouts with pp > 1 and tp = dp = 1")
    if schedule == "zb-v" and spec["num_layers"] % (2 * layout.pp):
        problems.append(f"zb-v needs --num-layers a multiple of 2 x pp = {2 * layout.pp}")
    if spec["global_batch_size"] % per_step:
        problems.append(f"--global-batch-size {spec['global_batch_size']} is not a multiple of "
                        f"micro-batch x dp = {per_step}")
    if spec["num_attention_heads"] % layout.tp or spec["hidden_size"] % layout.tp:
        problems.append(f"heads {spec['num_attention_heads']} / hidden {spec['hidden_size']} do "
                        f"not split over tp={layout.tp}")
    if spec["num_layers"] < layout.pp:
        problems.append(f"{spec['num_layers']} layers cannot fill pp={layout.pp} stages")
    if problems:
        raise ValueError(f"layout {layout}: " + "; ".join(problems))


def shared_flags(spec: dict, steps: int) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in spec.items()]
    return flags + [f"--train-iters={steps}"]


def engine_target(layout: Layout, spec: dict, steps: int, metrics: Path,
                  schedule: str = "1f1b") -> list[str]:
    return (["-m", "engine.train", *shared_flags(spec, steps), *layout.flags(), "--mock-data",
             "--precision", "fp32", "--no-progress", "--metrics-file", str(metrics),
             "--pipeline-schedule", schedule, "--device", "cpu"])   # the native side's device


def native_target(layout: Layout, spec: dict, steps: int, metrics: Path,
                  schedule: str = "1f1b") -> list[str]:
    return [str(REPO / "benchmarks" / "peers" / "native.py"), *shared_flags(spec, steps),
            *layout.flags(), "--schedule", schedule, "--out", str(metrics)]


def compare(engine_runs: list[list[dict]], native_runs: list[list[dict]], warmup: int) -> dict:
    """Median steady tokens/s of each side over its repeated runs, their ratio (engine / native),
    and the largest per-step loss difference of any repeat."""
    if not engine_runs or len(engine_runs) != len(native_runs):
        raise ValueError(f"need the same positive number of runs per side, got {len(engine_runs)} "
                         f"and {len(native_runs)}")
    e = [summarize(r, warmup)["tokens_per_s"] for r in engine_runs]
    n = [summarize(r, warmup)["tokens_per_s"] for r in native_runs]
    diff = max(max_rel_diff([x["loss"] for x in nat], [x["loss"] for x in eng])
               for eng, nat in zip(engine_runs, native_runs))
    return {"engine_tokens_per_s": statistics.median(e), "native_tokens_per_s": statistics.median(n),
            "ratio": statistics.median(e) / statistics.median(n), "max_rel_loss_diff": diff,
            "engine_runs_tokens_per_s": e, "native_runs_tokens_per_s": n,
            "engine_losses": [x["loss"] for x in engine_runs[0]],
            "native_losses": [x["loss"] for x in native_runs[0]]}


def run_layout(layout: Layout, spec: dict, steps: int, warmup: int, out_dir: Path,
               timeout_s: float = 600.0, threads_per_rank: int = 1, native_first: bool = False,
               repeats: int = 1, schedule: str = "1f1b") -> dict:
    """Train both sides on ``layout`` with ``schedule`` (one torchrun job each, ``repeats`` times,
    alternating which side goes first) and compare them."""
    check_layout(layout, spec, schedule)
    out_dir = Path(out_dir).resolve()  # the jobs run from the repository root
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list] = {"engine": [], "native": []}
    build = {"engine": engine_target, "native": native_target}
    for rep in range(repeats):
        order = ("native", "engine") if native_first != bool(rep % 2) else ("engine", "native")
        for side in order:
            metrics = out_dir / f"{side}-{layout.tag}-{schedule}-r{rep}.jsonl"
            metrics.unlink(missing_ok=True)
            torchrun(layout.world, build[side](layout, spec, steps, metrics, schedule),
                     metrics.with_suffix(".log"), timeout_s, threads_per_rank)
            runs[side].append(read_jsonl(metrics))
    return {"layout": str(layout), "world": layout.world, "schedule": schedule,
            **compare(runs["engine"], runs["native"], warmup)}


def report(results: list[dict], spec: dict, steps: int, warmup: int, rtol: float,
           repeats: int = 1, threads_per_rank: int = 1) -> str:
    rows = [[r["layout"], r.get("schedule", "1f1b"), r["world"], fmt(r["engine_tokens_per_s"], ".0f"),
             fmt(r["native_tokens_per_s"], ".0f"), fmt(r["ratio"], ".2f"),
             fmt(r["max_rel_loss_diff"], ".1e"),
             "yes" if r["max_rel_loss_diff"] <= rtol else f"NO (> {rtol:g})"] for r in results]
    table = markdown_table(["layout (tp,pp,dp)", "schedule", "ranks", "engine tokens/s",
                            "native tokens/s",
                            "engine / native", "max rel. loss diff", "losses agree"], rows)
    model = ", ".join(f"{k}={v}" for k, v in spec.items())
    runs = f"median of {repeats} jobs per side" if repeats > 1 else "one job per side"
    return (f"{table}\n\nModel and optimizer: {model}; {steps} steps, first {warmup} dropped from "
            f"throughput ({runs}, tokens over seconds of the steps kept), losses compared "
            f"over all {steps}.\n\n"
            f"{machine_note(max(r['world'] for r in results), threads_per_rank)}\n")


def parse(argv=None) -> argparse.Namespace:
    ap = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), help="tp,pp,dp triples")
    ap.add_argument("--schedules", nargs="+", default=["1f1b"], choices=("1f1b", "zb-h1", "zb-v"),
                    help="pipeline schedules to compare on layouts with pp > 1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from the throughput")
    ap.add_argument("--out", default="runs/peers")
    ap.add_argument("--repeats", type=int, default=1,
                    help="jobs per side and layout; the median tokens/s is reported")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    for key, value in SPEC.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    args = ap.parse_args(argv)
    at_least(ap, args, warmup=0, repeats=1, threads_per_rank=1,
             **{k: 1 for k in SPEC if k not in ("lr", "min_lr", "weight_decay", "clip_grad", "seed")})
    steps_past_warmup(ap, args, "the throughput is")
    positive_seconds(ap, args, "timeout")
    args.spec = spec = {k: getattr(args, k) for k in SPEC}
    try:
        args.layouts = [parse_layout(t) for t in args.layouts]
        args.cases = [(layout, s) for layout in args.layouts
                      for s in (args.schedules if layout.pp > 1 else ["1f1b"])]
        for layout, schedule in args.cases:
            check_layout(layout, spec, schedule)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    spec = args.spec
    cases = args.cases
    out = Path(args.out)
    results = []
    for i, (layout, schedule) in enumerate(cases):
        print(f"peers: layout {layout} ({layout.world} ranks), {schedule} ...", flush=True)
        results.append(run_layout(layout, spec, args.steps, args.warmup, out, args.timeout,
                                  args.threads_per_rank, native_first=bool(i % 2),
                                  repeats=args.repeats, schedule=schedule))
        r = results[-1]
        print(f"  engine {r['engine_tokens_per_s']:.0f} tokens/s, native {r['native_tokens_per_s']:.0f}"
              f" tokens/s, ratio {r['ratio']:.2f}, max rel. loss diff {r['max_rel_loss_diff']:.1e}",
              flush=True)
    text = report(results, spec, args.steps, args.warmup, args.loss_rtol, args.repeats,
                  args.threads_per_rank)
    (out / "peers.md").write_text(text)
    (out / "peers.json").write_text(json.dumps({"spec": spec, "steps": args.steps, "warmup": args.warmup,
                                                "repeats": args.repeats, "results": results}, indent=1))
    print(text)
    return 0 if all(r["max_rel_loss_diff"] <= args.loss_rtol for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
