"""The cost of guarding steps: step time with ``--rerun-on-anomaly --spike-factor`` against without,
and what one re-run costs.

One process trains the same GPT three times for ``--steps`` steps, round-robin so that load from
other work on the host hits all three alike: plain; guarded (per step: the random states and loss
scaler saved, one multi-tensor norm of every DP bucket's local gradients, two counts more on the
statistics all-reduce); guarded with a transient NaN planted at step ``--fault-step``. Reported:
the fastest and the median step time of each (warm-up steps dropped; on a shared host the fastest
step is the least disturbed estimate of a step's own cost), the guarded/plain ratios, the faulty
step's time over the guarded median (a re-run is one more forward/backward, the attribution's all-gather
and host reads), and whether the faulty run's losses equal the plain run's (they must).

    python -m benchmarks.host.resilience [--steps 30] [--fault-step 15] [--hidden 256] [--layers 4]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from engine.config.cli import parse_args
from engine.observe.faults import GradFault
from engine.training.trainer import Trainer

WARMUP = 3


def build(argv, fault_step=None):
    trainer = Trainer(parse_args(argv))
    if fault_step is not None:
        GradFault(0, fault_step, "layers.0.mlp.fc1.weight").install(trainer)
    return trainer


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault-step", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    if not WARMUP < args.fault_step <= args.steps:
        raise SystemExit(f"--fault-step must be in ({WARMUP}, --steps]")
    base = ["--mock-data", "--vocab-size", "1024", "--no-progress", "--num-layers", str(args.layers),
            "--hidden-size", str(args.hidden), "--num-attention-heads", "4", "--seq-length", "128",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(args.steps),
            "--no-log-straggler"]
    guarded = base + ["--rerun-on-anomaly", "--spike-factor", "10"]
    runs = {"plain": build(base), "guarded": build(guarded),
            "faulty": build(guarded, args.fault_step)}
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    torch.manual_seed(0)
    for step in range(args.steps):
        for name, t in runs.items():  # round-robin: the same host load on each
            rec = t.train_one(step)
            if t.guard is not None:
                rec.update(t.guard.record())
            times[name].append(rec)  # step_time_s is filled after the next step's wait
            losses[name].append(rec["loss"])
    for name, t in runs.items():
        t.flush()
        times[name] = [rec["step_time_s"] for rec in times[name]]
    steady = {k: [v for i, v in enumerate(ts) if i >= WARMUP and i != args.fault_step - 1]
              for k, ts in times.items()}
    med = {k: statistics.median(v) for k, v in steady.items()}
    best = {k: min(v) for k, v in steady.items()}
    row = {"plain_s": med["plain"], "guarded_s": med["guarded"],
           "guarded_over_plain": med["guarded"] / med["plain"],
           "best_plain_s": best["plain"], "best_guarded_s": best["guarded"],
           "best_guarded_over_plain": best["guarded"] / best["plain"],
           "rerun_step_over_guarded": times["faulty"][args.fault_step - 1] / med["guarded"],
           "faulty_losses_equal_plain": losses["faulty"] == losses["plain"],
           "reruns": len(runs["faulty"].guard.anomalies)}
    print(f"fastest step: plain {best['plain'] * 1e3:.1f} ms, guarded {best['guarded'] * 1e3:.1f} ms "
          f"(x{row['best_guarded_over_plain']:.3f}); median step: plain {med['plain'] * 1e3:.1f} ms, "
          f"guarded {med['guarded'] * 1e3:.1f} ms (x{row['guarded_over_plain']:.3f}); the re-run step took x{row['rerun_step_over_guarded']:.2f} "
          f"the guarded median; faulty run's losses equal the plain run's: "
          f"{row['faulty_losses_equal_plain']} ({row['reruns']} re-run)")
    for t in runs.values():
        t.close()
    return row


if __name__ == "__main__":
    main()
