"""ZeRO-3 against ZeRO-2 at dp=2 through the real trainer on this machine: step time, the bytes each
rank hands to DP collectives, parameter bytes per rank, the peak of parameter memory and the
losses, for the same model over the same steps.

    python -m benchmarks.memory.zero3                                   # 8 x 256, 12 steps, 3 pairs
    python -m benchmarks.memory.zero3 --steps 4 --pairs 1 --hidden-size 64   # a quick look

- Step time: the two strategies run in pairs of jobs in one group of 2 gloo ranks, alternating
  which goes first (ZeRO-2, ZeRO-3, then ZeRO-3, ZeRO-2, ...), so that the machine's load falls
  on both alike; the first step of every job is a warm-up and left out. The ratio is ZeRO-3's
  total seconds over its total steps divided by ZeRO-2's (``ratio``: totals, never a mean of
  per-step rates).
- Bytes: ``dp_comm_bytes`` (the payload this rank handed to DP collectives, counted from the
  tensors passed, parallel/runtime/comm.py) and ``dp_comm_wire_bytes`` (the ring model's bytes
  sent) per step: ZeRO-2 reduce-scatters the fp32 gradients and all-gathers every parameter shard
  once after the update; ZeRO-3 gathers every unit's shard in each micro-batch's forward and again
  in its backward (docs/data_parallel.md).
- Memory: ``param_bytes``, ``grad_bytes`` and ``optimizer_state_bytes`` of rank 0 (exact,
  parallel/dp/memory.py), and the parameters' peak: ZeRO-2 holds the whole flat parameter buffer
  throughout; ZeRO-3 its 1/dp shards plus the whole units gathered at once, whose most over the
  job is read after every gather (engine/dryrun/record.py ``GatheredPeak``). The process's
  resident memory is not a usable figure here: the ranks run job after job and RSS only grows,
  and torch's runtime outweighs this model.
- Losses: every job's losses against the first ZeRO-2 job's (the largest relative difference is
  printed): ZeRO-3 reduces the same gradients and gathers the same values, so they agree to fp32
  rounding (bit for bit on some models, not on every one: the gathered weights are other tensors
  than ZeRO-2's flat buffer, and the CPU's kernels need not round alike on both).

CPU wall-clock figures depend on the machine's load: read the ratio, which pairs the two, before
the seconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config.cli import parse_args  # noqa: E402
from engine.dryrun.record import GatheredPeak  # noqa: E402
from engine.observe.metrics import summarize_run  # noqa: E402
from engine.training.trainer import Trainer  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

DP = 2
STRATEGIES = {"ZeRO-2": "optim_grads", "ZeRO-3": "optim_grads_params"}
MEMORY = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def flags(args, strategy: str) -> list[str]:
    micro = args.micro_batch_size
    return ["--mock-data", "--vocab-size", "1024", "--no-progress", "--device", "cpu",
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * args.m * DP),
            "--dp", str(DP), "--train-iters", str(args.steps), "--lr-warmup-iters", "0",
            "--precision", "fp32", "--peak-tflops", "1",
            "--data-parallel-sharding-strategy", STRATEGIES[strategy]]


def order(pairs: int) -> list[str]:
    """The jobs' strategies, each pair alternating which runs first.

    >>> order(2)
    ['ZeRO-2', 'ZeRO-3', 'ZeRO-3', 'ZeRO-2']
    """
    first, second = list(STRATEGIES)
    return [s for k in range(pairs) for s in ((first, second) if k % 2 == 0 else (second, first))]


def run_rank(ps, jobs: list[tuple[str, list[str]]]) -> list[dict]:
    out = []
    for strategy, argv in jobs:
        trainer = Trainer(parse_args(argv))
        gathered = GatheredPeak(trainer.optimizer)   # ZeRO-3's store; none under ZeRO-2
        records = trainer.train().records
        trainer.reducer.remove_hooks()
        total = summarize_run(records, warmup=1)
        kept = records[1:]
        memory = {k: records[-1][k] for k in MEMORY}
        out.append({"strategy": strategy, "seconds": total["seconds"], "steps": total["steps"],
                    "losses": [r["loss"] for r in records],
                    "dp_bytes": statistics.median(r["dp_comm_bytes"] for r in kept),
                    "dp_wire_bytes": statistics.median(r["dp_comm_wire_bytes"] for r in kept),
                    "memory": memory, "gathered_peak": gathered.peak,
                    "param_peak": memory["param_bytes"] + gathered.peak})
    return out


def ratio(runs: list[dict], of: str, to: str) -> float:
    """Seconds per step of ``of`` over ``to``: each strategy's total seconds over its total steps."""
    per_step = {}
    for name in (of, to):
        mine = [r for r in runs if r["strategy"] == name]
        per_step[name] = sum(r["seconds"] for r in mine) / sum(r["steps"] for r in mine)
    return per_step[of] / per_step[to]


def pair_ratios(runs: list[dict]) -> list[float]:
    """Each pair's own ratio (ZeRO-3 over ZeRO-2 seconds per step, jobs in run order, two by two):
    their spread shows how much the machine's load moved between jobs."""
    out = []
    for a, b in zip(runs[0::2], runs[1::2]):
        per = {r["strategy"]: r["seconds"] / r["steps"] for r in (a, b)}
        out.append(per["ZeRO-3"] / per["ZeRO-2"])
    return out


def max_loss_gap(runs: list[dict]) -> float:
    """The largest relative difference of any job's per-step losses from the first job's."""
    ref = runs[0]["losses"]
    return max(abs(x - y) / abs(y) for r in runs for x, y in zip(r["losses"], ref))


def table(runs: list[dict]) -> str:
    """The markdown table of one benchmark: a row per strategy, the ratio row last."""
    rows = ["| strategy | s/step (total/steps) | dp_comm_bytes/step | dp_comm_wire_bytes/step | "
            "param_bytes/rank | grad_bytes/rank | optimizer_state_bytes/rank | gathered peak | "
            "parameter peak |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in STRATEGIES:
        mine = [r for r in runs if r["strategy"] == name]
        one, m = mine[0], mine[0]["memory"]
        secs = sum(r["seconds"] for r in mine) / sum(r["steps"] for r in mine)
        rows.append(f"| {name} | {secs:.4f} | {one['dp_bytes']:,.0f} | {one['dp_wire_bytes']:,.0f} | "
                    f"{m['param_bytes']:,} | {m['grad_bytes']:,} | {m['optimizer_state_bytes']:,} | "
                    f"{one['gathered_peak']:,} | {one['param_peak']:,} |")
    pairs = ", ".join(f"{x:.3f}" for x in pair_ratios(runs))
    rows.append(f"\nstep time ZeRO-3 / ZeRO-2: {ratio(runs, 'ZeRO-3', 'ZeRO-2'):.3f} "
                f"({sum(r['steps'] for r in runs) // 2} steps each after warm-up, "
                f"{len(runs) // 2} alternating pairs; each pair's own: {pairs}); losses: largest "
                f"relative difference {max_loss_gap(runs):.3g} over {len(runs[0]['losses'])} steps")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--m", type=int, default=2, help="micro-batches per step on each rank")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=3, help="ZeRO-2 / ZeRO-3 job pairs")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.pairs < 1:
        parser.error("--steps must be >= 2 (the first is a warm-up) and --pairs >= 1")
    jobs = [(s, flags(args, s)) for s in order(args.pairs)]
    runs = run_distributed(run_rank, grid=RankGrid(dp=DP), args=(jobs,), timeout_s=1800,
                           deadline_s=3600)[0]
    print(f"## ZeRO-3 against ZeRO-2, dp {DP} (rank 0; {args.num_layers} x {args.hidden_size}, "
          f"seq {args.seq_length}, {args.m} micro-batches of {args.micro_batch_size} per rank, "
          f"fp32)\n")
    print(table(runs))
    return runs


if __name__ == "__main__":
    main()
