"""Mixture of experts: host time per layer, dispatch throughput by ep, expert load balancing over
training, and the validation loss of an MoE model against a dense model of the same active FLOPs.

0. **Host time** (this process, one thread): one MoE transformer layer's forward and backward
   against a dense layer of the same active FLOPs at a host-bound size, and the aten ops each
   dispatches (benchmarks/host/moe_layer.py); target: the MoE layer within 1.5x the dense one.
1. **Throughput** (4 ranks, dp 4, mock data): tokens/s of a small MoE gpt2 model at ep 1, 2 and 4
   with ``--moe-token-dispatcher-type alltoall`` and ``allgather``; a dispatcher the engine
   refuses (its configuration check, before any launch) is skipped and the output says so. One
   ``torchrun --standalone`` job per (dispatcher, ep); tokens/s is its total tokens over its
   total step time after ``--warmup`` steps (benchmarks.common.summarize), with its EP bytes per
   step.
2. **Balancing** (1 rank, the built-in corpus): ``moe_load_imbalance`` (max over mean of the
   step's expert load, metrics.jsonl) per step, with the aux loss (softmax router,
   ``--moe-aux-loss-coeff``) against aux-loss-free balancing (``--moe-router-enable-expert-bias``
   with ``--moe-router-score-function sigmoid``, no balancing loss) and against no balancing.
3. **Quality** (the same runs): the validation loss of the MoE model (E experts of width f/K,
   top-K: the active MLP FLOPs of the dense model's width-f MLP, plus a router of 2 h E per token)
   against the dense model, same data, steps and learning rate.

Figures: a table printed as markdown and ``--out``/moe.json; the plot ``--plot``
(docs/img/moe.png by default: imbalance per step, validation loss per evaluation, tokens/s).

    python -m benchmarks.convergence.moe [--steps 100] [--throughput-steps 8] [--out runs/moe] [--host-only]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import (LaunchFailed, fmt, fmt_bytes, machine_note, markdown_table,
                               read_jsonl, summarize, torchrun)

MODEL = ["--num-layers=4", "--hidden-size=128", "--num-attention-heads=4", "--seq-length=64",
         "--ffn-hidden-size=512", "--precision=fp32", "--no-progress", "--device=cpu"]
EXPERTS, TOPK = 8, 2
MOE = [f"--num-experts={EXPERTS}", f"--moe-router-topk={TOPK}",
       f"--moe-ffn-hidden-size={512 // TOPK}"]  # K experts of f/K: the dense MLP's active FLOPs
BALANCING = {  # name -> router flags
    "aux loss": ["--moe-aux-loss-coeff=0.01"],
    "aux-loss-free (expert bias)": ["--moe-router-score-function=sigmoid",
                                    "--moe-router-enable-expert-bias",
                                    "--moe-router-bias-update-rate=0.01",
                                    "--moe-router-load-balancing-type=none"],
    "no balancing": ["--moe-aux-loss-coeff=0"],
}
DISPATCHERS = ("alltoall", "allgather")


def refused(flags: list[str]) -> str | None:
    """Why engine.train refuses ``flags`` (its own parser and configuration checks), or None."""
    from engine.config.cli import parse_args
    try:
        parse_args(flags)
    except (Exception, SystemExit) as exc:  # ConfigError, ValueError, argparse's exit
        return str(exc) or type(exc).__name__
    return None


def throughput(args, out: Path) -> list[dict]:
    rows = []
    for dispatcher in DISPATCHERS:
        for ep in args.ep:
            flags = [*MODEL, *MOE, "--mock-data", "--vocab-size=512", "--dp=4", f"--ep={ep}",
                     "--micro-batch-size=4", "--global-batch-size=16",
                     f"--moe-token-dispatcher-type={dispatcher}", "--moe-aux-loss-coeff=0.01",
                     f"--train-iters={args.throughput_steps}"]
            why = refused(flags)
            if why:
                print(f"skipped: --moe-token-dispatcher-type {dispatcher} (ep {ep}): the engine "
                      f"refuses it: {why.splitlines()[0]}", file=sys.stderr)
                rows.append({"dispatcher": dispatcher, "ep": ep, "skipped": why.splitlines()[0]})
                continue
            metrics = out / f"tput-{dispatcher}-ep{ep}.jsonl"
            try:
                torchrun(4, ["-m", "engine.train", *flags, "--metrics-file", str(metrics)],
                         metrics.with_suffix(".log"), args.timeout)
            except LaunchFailed as exc:
                print(f"skipped: {dispatcher} ep {ep} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
                rows.append({"dispatcher": dispatcher, "ep": ep, "skipped": "the run failed"})
                continue
            records = read_jsonl(metrics)
            s = summarize(records, args.warmup)
            timed = [r for r in records if r["step"] > args.warmup]
            rows.append({"dispatcher": dispatcher, "ep": ep, "tokens_per_s": s["tokens_per_s"],
                         "ep_comm_bytes": sum(r.get("ep_comm_bytes") or 0 for r in timed) / len(timed)})
    return rows


def training(args, out: Path) -> dict:
    """One single-rank run per balancing mode and the dense run, on the built-in corpus."""
    runs = {}
    common = [*MODEL, "--micro-batch-size=8", "--global-batch-size=8", f"--lr={args.lr}",
              f"--train-iters={args.steps}", f"--eval-interval={args.eval_interval}",
              "--eval-iters=4", "--lr-warmup-iters=10"]
    for name, flags in [*((f"MoE, {k}", [*MOE, *v]) for k, v in BALANCING.items()), ("dense", [])]:
        tag = name.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", "")
        metrics = out / f"train-{tag}.jsonl"
        start = time.monotonic()
        # no --run-dir: it would save checkpoints, which the expert bias is refused with
        torchrun(1, ["-m", "engine.train", *common, *flags, "--metrics-file", str(metrics)],
                 metrics.with_suffix(".log"), args.timeout)
        records = read_jsonl(metrics)
        runs[name] = {"imbalance": [r.get("moe_load_imbalance") for r in records],
                      "valid": [(r["step"], r["valid_loss"]) for r in records
                                if r.get("valid_loss") is not None],
                      "loss": [r["loss"] for r in records], "seconds": time.monotonic() - start}
    return runs


def plot(runs: dict, tput: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, run in runs.items():
        if name != "dense":
            axes[0].plot(range(1, len(run["imbalance"]) + 1), run["imbalance"], label=name[5:])
        steps, losses = zip(*run["valid"]) if run["valid"] else ((), ())
        axes[1].plot(steps, losses, marker="o", label=name)
    axes[0].set(xlabel="step", ylabel="moe_load_imbalance (max / mean)", title="expert load")
    axes[1].set(xlabel="step", ylabel="validation loss", title="MoE vs dense, same active FLOPs")
    for d in DISPATCHERS:
        pts = [(r["ep"], r["tokens_per_s"]) for r in tput if r["dispatcher"] == d and "tokens_per_s" in r]
        if pts:
            axes[2].plot(*zip(*pts), marker="o", label=d)
    axes[2].set(xlabel="ep (dp 4)", ylabel="tokens/s", title="throughput (4 gloo ranks, 2 cores)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def tables(tput: list[dict], runs: dict, window: int) -> str:
    t1 = markdown_table(["dispatcher", "ep", "tokens/s", "EP bytes per step"], [
        [r["dispatcher"], r["ep"], fmt(r.get("tokens_per_s"), ".0f"),
         fmt_bytes(r.get("ep_comm_bytes")) if "skipped" not in r else "skipped: " + r["skipped"][:60]]
        for r in tput])
    rows = []
    for name, run in runs.items():
        imb = [x for x in run["imbalance"] if x is not None]
        tail = imb[-window:]
        rows.append([name, fmt(imb[0] if imb else None, ".2f"), fmt(max(imb) if imb else None, ".2f"),
                     fmt(sum(tail) / len(tail) if tail else None, ".3f"),
                     fmt(run["valid"][0][1] if run["valid"] else None, ".3f"),
                     fmt(run["valid"][-1][1] if run["valid"] else None, ".3f"),
                     fmt(sum(run["loss"][-window:]) / len(run["loss"][-window:]), ".3f")])
    t2 = markdown_table(["run", "imbalance step 1", "imbalance max",
                         f"imbalance last {window} steps", "valid loss first", "valid loss last",
                         f"train loss last {window}"], rows)
    return t1 + "\n\n" + t2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--throughput-steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps dropped from throughput")
    p.add_argument("--steps", type=int, default=100, help="steps of each training run")
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--window", type=int, default=20, help="last steps averaged in the table")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="runs/moe")
    p.add_argument("--plot", default="docs/img/moe.png")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--host-only", action="store_true", help="the host-time table alone")
    p.add_argument("--host-rounds", type=int, default=15)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    from benchmarks.host.moe_layer import measure, table
    host = [measure(block, args.host_rounds) for block in ("gpt2", "llama")]
    print(table(host) + "\n")
    (out / "moe_host.json").write_text(json.dumps(host, indent=1))
    if args.host_only:
        return 0
    tput = [] if args.skip_throughput else throughput(args, out)
    runs = training(args, out)
    plot(runs, tput, Path(args.plot))
    (out / "moe.json").write_text(json.dumps({"throughput": tput, "training": runs}, indent=1))
    print(tables(tput, runs, args.window))
    print(f"\n{machine_note(4)} Total {time.monotonic() - start:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
