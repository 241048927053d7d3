"""Strong and weak scaling of one recipe over the process counts this machine (or node) can launch.

    python -m benchmarks.communication.scaling [--config recipe.yaml] [--nprocs 1,2,4,8] [--steps 8] [--warmup 3]
                                 [--modes strong,weak] [--out runs/bench]

For each process count n, a set of layouts runs as separate ``torchrun --standalone
--nproc-per-node n -m engine.train`` jobs reading each job's ``--metrics-file``: data parallel only,
plus tensor/pipeline mixes where n allows (n divisible by 4: tp=2 and pp=2 with the rest DP; by 8
also tp=2 x pp=2); ``--layouts`` replaces the list. Two modes:
- strong: the global batch is fixed (the recipe's, or ``--global-batch-size``), so more DP ranks
  each take a smaller share of it;
- weak: the batch per DP rank is fixed (``--batch-per-dp``), so the global batch grows with dp.

Efficiency is tokens/s over n times the tokens/s of the one-process run of the same mode, measured
in the same invocation (it is added when ``--nprocs`` lacks 1). Figures are steady-state: the first
``--warmup`` steps of each job are dropped and every figure is a total over the rest (tokens over
seconds, FLOPs over seconds: the trainer's own summary). MFU divides by one thread's measured fp32 matmul rate
on CPUs (``--peak-tflops`` to give a device's peak instead). Without ``--config`` the recipe is a
small GPT-2 on mock data. Writes ``scaling.md`` (tables), ``scaling.png`` (plot) and
``scaling.json`` under ``--out``; a layout the recipe cannot be split over is listed as skipped with
the engine's reason, a job that fails as failed, and the exit status is 1 when any job failed.
On a cluster node, run it there: the same torchrun launches use that node's devices.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import (BenchParser, Layout, LaunchFailed, at_least, fmt, positive_seconds,  # noqa: E402
                               fmt_bytes, machine_note, markdown_table, parse_int_list,
                               parse_layout, read_jsonl, scaling_efficiency, steps_past_warmup,
                               single_thread_peak_tflops, summarize, torchrun)

DEFAULT_RECIPE = {"block": "gpt2", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                  "seq_length": 128, "vocab_size": 512, "mock_data": True, "micro_batch_size": 2,
                  "global_batch_size": 16, "precision": "fp32", "lr": 1e-3, "lr_warmup_iters": 2}
# outputs a recipe may ask for that a benchmark job must not produce, and its checkpoint to load
# (an empty --load= clears it: every job starts from scratch)
QUIET = ["--save=", "--load=", "--plot=", "--timeline=", "--eval-interval=0", "--no-progress"]
MODES = ("strong", "weak")


def default_layouts(n: int) -> list[Layout]:
    """Data parallel only, plus tp=2 / pp=2 mixes when n is a multiple of 4 (and both when of 8)."""
    layouts = [Layout(1, 1, n)]
    if n % 4 == 0:
        layouts += [Layout(2, 1, n // 2), Layout(1, 2, n // 2)]
    if n % 8 == 0:
        layouts.append(Layout(2, 2, n // 4))
    return layouts


def plan_layouts(nprocs: list[int], explicit: list[Layout] | None) -> list[Layout]:
    """Every layout of the invocation, the one-process baseline first."""
    layouts = list(explicit) if explicit else [l for n in nprocs for l in default_layouts(n)]
    if Layout(1, 1, 1) not in layouts:
        layouts.insert(0, Layout(1, 1, 1))
    layouts.sort(key=lambda l: (l.world, l.dp != l.world, l.tp, l.pp))
    return list(dict.fromkeys(layouts))


def global_batch(mode: str, layout: Layout, strong_batch: int, batch_per_dp: int) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return strong_batch if mode == "strong" else batch_per_dp * layout.dp


def recipe_flags(config: str | None) -> list[str]:
    if config:  # absolute: the jobs run from the repository root
        return ["--config", str(Path(config).resolve())]
    flags = []
    for key, value in DEFAULT_RECIPE.items():
        flag = f"--{key.replace('_', '-')}"
        flags += [flag] if value is True else [f"{flag}={value}"]
    return flags


def job_argv(base: list[str], layout: Layout, batch: int, steps: int, metrics: Path,
             peak_tflops: float | None) -> list[str]:
    argv = [*base, *layout.flags(), f"--global-batch-size={batch}", f"--train-iters={steps}",
            *QUIET, "--metrics-file", str(metrics)]
    return argv + ([f"--peak-tflops={peak_tflops}"] if peak_tflops else [])


def why_not(argv: list[str], world: int) -> str | None:
    """The engine's own pre-launch verdict on this job (None: it can run)."""
    from engine.base import ConfigError
    from engine.config.cli import parse_args
    from engine.training.validate import validate_run
    from parallel.grid.launch import LaunchEnv
    try:
        cfg = parse_args(argv)
        cfg.data.num_microbatches(cfg.parallel.grid(world).dp)
        validate_run(cfg, LaunchEnv(0, world, 0, world))
    except (ConfigError, ValueError) as exc:
        return str(exc)
    return None


def run_mode(mode: str, layouts: list[Layout], base: list[str], args, peak: float | None) -> list[dict]:
    rows = []
    for layout in layouts:
        batch = global_batch(mode, layout, args.strong_batch, args.batch_per_dp)
        metrics = Path(args.out) / mode / f"{layout.tag}.jsonl"
        argv = job_argv(base, layout, batch, args.steps, metrics, peak)
        row = {"mode": mode, "procs": layout.world, "layout": str(layout), "global_batch": batch,
               "status": "ok"}
        reason = why_not(argv, layout.world)
        if reason:
            rows.append({**row, "status": "skipped", "reason": reason})
            print(f"scaling: {mode} {layout}: skipped ({reason})", flush=True)
            continue
        print(f"scaling: {mode} {layout} on {layout.world} processes, global batch {batch} ...",
              flush=True)
        try:
            runs = []
            for rep in range(args.repeats):
                path = metrics.with_name(f"{layout.tag}-r{rep}.jsonl")
                path.unlink(missing_ok=True)
                job = job_argv(base, layout, batch, args.steps, path, peak)
                torchrun(layout.world, ["-m", "engine.train", *job], path.with_suffix(".log"),
                         args.timeout, args.threads_per_rank)
                runs.append(summarize(read_jsonl(path), args.warmup))
            rows.append({**row, **median_run(runs)})
        except (LaunchFailed, ValueError, OSError) as exc:
            rows.append({**row, "status": "failed", "reason": str(exc).splitlines()[0]})
            print(f"scaling: {mode} {layout}: FAILED: {exc}", flush=True)
    add_efficiency(rows)
    return rows


def median_run(runs: list[dict]) -> dict:
    """The summary of the run with the median tokens/s (the lower middle for an even count)."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def add_efficiency(rows: list[dict]) -> None:
    """Efficiency of every measured row against the (1,1,1) row of the same list."""
    base = next((r for r in rows if r["layout"] == "(1,1,1)" and r["status"] == "ok"), None)
    for r in rows:
        ok = r["status"] == "ok" and base is not None
        r["efficiency"] = (scaling_efficiency(r["tokens_per_s"], r["procs"], base["tokens_per_s"])
                           if ok else None)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(rows: list[dict]) -> str:
    headers = ["procs", "layout (tp,pp,dp)", "global batch", "tokens/s", "TFLOP/s per device",
               "MFU", "bubble theory / measured", "DP payload per step",
               "DP wire per step (ring model)", "efficiency"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["procs"], r["layout"], r["global_batch"], f"{r['status']}: {r['reason']}",
                         "", "", "", "", "", ""])
            continue
        bubble = ("-" if r["bubble_theoretical"] is None else
                  f"{r['bubble_theoretical']:.2f} / {fmt(r['bubble_measured'], '.2f')}")
        body.append([r["procs"], r["layout"], r["global_batch"], fmt(r["tokens_per_s"], ".0f"),
                     fmt(r["tflops_per_device"], ".4f"), percent(r["mfu"]), bubble,
                     fmt_bytes(r["dp_comm_bytes"]), fmt_bytes(r.get("dp_comm_wire_bytes")),
                     fmt(r["efficiency"], ".2f")])
    return markdown_table(headers, body)


def plot(results: dict[str, list[dict]], path: Path, cores: int | None = None) -> None:
    """Tokens/s and efficiency against processes; ``cores``: where ranks start sharing cores."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for mode, marker in zip(results, ("o", "s")):
        ok = [r for r in results[mode] if r["status"] == "ok"]
        dp_only = [r for r in ok if r["layout"] == f"(1,1,{r['procs']})"]
        mixes = [r for r in ok if r not in dp_only]
        for ax, key in ((axes[0], "tokens_per_s"), (axes[1], "efficiency")):
            line, = ax.plot([r["procs"] for r in dp_only], [r[key] for r in dp_only],
                            marker=marker, label=f"{mode}, dp only")
            ax.scatter([r["procs"] for r in mixes], [r[key] for r in mixes], marker=marker,
                       facecolors="none", edgecolors=line.get_color(), label=f"{mode}, tp/pp mixes")
            for r in (mixes if key == "tokens_per_s" else []):  # labels once, on the left
                ax.annotate(r["layout"], (r["procs"], r[key]), fontsize=6, xytext=(3, 2),
                            textcoords="offset points")
    axes[0].set(xlabel="processes", ylabel="tokens/s", title="throughput", xscale="log", xticks=[])
    axes[1].set(xlabel="processes", ylabel="tokens/s / (n x one process)", title="efficiency",
                xscale="log")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    if cores is not None:
        for ax in axes:
            ax.axvline(cores, color="red", lw=0.8, ls=":", label=f"{cores} CPU cores")
    procs = sorted({r["procs"] for rows in results.values() for r in rows})
    for ax in axes:
        ax.set_xticks(procs, [str(p) for p in procs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse(argv=None) -> argparse.Namespace:
    ap = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe (default: a small GPT-2 on mock data)")
    ap.add_argument("--nprocs", default="1,2,4,8", help="process counts, comma-separated")
    ap.add_argument("--layouts", nargs="+", help="explicit tp,pp,dp triples instead of the defaults")
    ap.add_argument("--modes", default="strong,weak")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped from every job's figures")
    ap.add_argument("--global-batch-size", dest="strong_batch", type=int,
                    help="strong scaling's fixed global batch (default: the recipe's)")
    ap.add_argument("--batch-per-dp", type=int, default=8, help="weak scaling's batch per DP rank")
    ap.add_argument("--repeats", type=int, default=1,
                    help="jobs per layout; the run with the median tokens/s is reported")
    ap.add_argument("--peak-tflops", type=float, help="device peak for MFU (default on CPU: measured)")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    at_least(ap, args, warmup=0, repeats=1, batch_per_dp=1, threads_per_rank=1)
    steps_past_warmup(ap, args, "tokens/s is")
    if args.strong_batch is not None and args.strong_batch < 1:
        ap.error(f"--global-batch-size must be at least 1, got {args.strong_batch}")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < float("inf"):
        ap.error(f"--peak-tflops must be a positive number, got {args.peak_tflops}")
    positive_seconds(ap, args, "timeout")
    args.out = str(Path(args.out).resolve())  # the jobs run from the repository root
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"--modes takes strong, weak or both, got {','.join(args.modes)!r}")
    try:
        args.nprocs = parse_int_list(args.nprocs, "--nprocs")
        args.layouts = [parse_layout(t) for t in args.layouts] if args.layouts else None
    except ValueError as exc:
        ap.error(str(exc))
    from engine.config.cli import parse_args
    args.base = recipe_flags(args.config)  # every job's recipe flags
    try:  # the recipe, as every job will read it (ConfigError is a ValueError)
        recipe = parse_args(args.base)
    except (ValueError, OSError) as exc:
        ap.error(f"--config {args.config}: {exc}")
    if args.strong_batch is None:
        args.strong_batch = recipe.data.global_batch_size
    return args


def main(argv=None) -> int:
    args = parse(argv)
    layouts = plan_layouts(args.nprocs, args.layouts)
    base = args.base
    from engine.device.runtime import detect_device_type
    device_type = detect_device_type("auto")
    on_cpu = device_type == "cpu"
    peak = args.peak_tflops
    if peak is None and on_cpu:
        peak = single_thread_peak_tflops() * args.threads_per_rank
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {mode: run_mode(mode, layouts, base, args, peak) for mode in args.modes}
    text = render(results, args, peak, max(l.world for l in layouts), device_type)
    out = Path(args.out)
    (out / "scaling.md").write_text(text)
    (out / "scaling.json").write_text(json.dumps(results, indent=1))
    if any(r["status"] == "ok" for rows in results.values() for r in rows):
        plot(results, out / "scaling.png", os.cpu_count() if on_cpu else None)
    print(text)
    return 1 if any(r["status"] == "failed" for rows in results.values() for r in rows) else 0


def peak_label(peak: float | None, args) -> str:
    """Where the MFU peak came from: ``--peak-tflops``, one thread's measured rate times the
    threads per rank (CPU), or the device's table peak the trainer divides by (``peak`` None)."""
    if args.peak_tflops is not None:
        return f"MFU peak: {fmt(peak, '.3f')} TFLOP/s per rank (given with --peak-tflops)."
    if peak is None:
        return "MFU peak: each rank's device table peak (the trainer's own)."
    n = args.threads_per_rank
    threads = "one thread's" if n == 1 else f"{n} threads x one thread's"
    return (f"MFU peak: {fmt(peak, '.3f')} TFLOP/s per rank ({threads} measured fp32 matmul "
            f"rate).")


def render(results: dict[str, list[dict]], args, peak: float | None, max_world: int,
           device_type: str = "cpu") -> str:
    """The markdown page: what was run, one table per mode, where it ran."""
    recipe = args.config or ", ".join(f"{k}={v}" for k, v in DEFAULT_RECIPE.items())
    jobs = f"median of {args.repeats} jobs per layout" if args.repeats > 1 else "one job per layout"
    head = [f"Recipe: {recipe}.", f"{args.steps} steps per job, first {args.warmup} dropped; "
            f"tokens/s = tokens / seconds over the steps kept, {jobs}."]
    if "strong" in args.modes:
        head.append(f"Strong scaling: global batch {args.strong_batch}.")
    if "weak" in args.modes:
        head.append(f"Weak scaling: {args.batch_per_dp} sequences per DP rank.")
    head.append(peak_label(peak, args))
    head.append("DP payload: the bytes rank 0 hands to DP collectives per step (dp_comm_bytes); "
                "DP wire: the ring-model bytes it puts on its link (dp_comm_wire_bytes).")
    parts = [" ".join(head)]
    for mode, rows in results.items():
        parts.append(f"### {mode} scaling\n\n{table(rows)}")
    parts.append(machine_note(max_world, args.threads_per_rank, device_type))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
