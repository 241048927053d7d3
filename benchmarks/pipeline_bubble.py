"""Pipeline bubble of GPipe, 1F1B and interleaved 1F1B through the real trainer: theory, simulation
and measurement side by side, with a Gantt chart per run.

    python -m benchmarks.pipeline_bubble                       # pp 2 and 4, m 4 and 8
    python -m benchmarks.pipeline_bubble --pp 4 --m 8 16 --hidden-size 256 --out runs/bench

For every (pp, m) each schedule trains a small GPT for a few steps on pp gloo processes (tp=dp=1,
one spawned group per pp, one thread per rank). Per run it prints:

- theoretical: the closed form for equal stages, (p-1)/(v*m + p-1) (parallel/pipeline/bubble.py);
- simulated: ``bubble.simulate`` replaying the very schedule the executor ran, with each virtual
  stage's mean forward and backward device time measured from the events (transfers free), per
  step; totals over the measured steps (the trainer's ``bubble_simulated``);
- measured: the ``bubble_measured`` metric: per rank the device time in pipeline transfers plus the
  idle before its first and after its last action, over the pipeline phase; averaged over ranks;
  totals over the measured steps (idle time over pipeline time). Optimizer, DP reduction and
  clipping are not in it (they are the ``time_*`` keys);
- |measured - simulated|; for the last step, the replay with stage means, the replay with each
  action's own measured time (transfers still free: what the variation of compute times adds)
  and the measurement (the rest is what the transfers cost); the step time and the mean forward
  and backward time.

The first ``--warmup`` steps of every run are left out. Two PNG Gantt charts per run go to
``--out``: the measured last step and the simulation. On a machine with fewer cores than pipeline
ranks the processes share cores, so measured times include waiting for a core; the script says so
when it detects it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gantt import draw_gantt  # noqa: E402
from engine.cli import parse_args  # noqa: E402
from engine.metrics import summarize_run  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from parallel.pipeline.bubble import measured_bubble, simulate, theoretical_bubble  # noqa: E402
from parallel.pipeline.schedules import build_schedule  # noqa: E402
from parallel.topology import RankGrid  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def model_flags(args) -> list[str]:
    return ["--mock-data", "--vocab-size", "1024", "--no-progress", "--device", "cpu",
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(args.steps),
            "--lr-warmup-iters", "0", "--peak-tflops", "1"]


def run_rank(ps, runs: list[tuple[str, int, int, list[str]]]) -> list[dict]:
    """Train each (schedule, m, vp, flags) and keep this rank's events of the last step."""
    out = []
    for schedule, m, vp, flags in runs:
        trainer = Trainer(parse_args(flags))
        last, run = {}, trainer.stepper.run

        def keep_events(batches, lr):
            result = run(batches, lr)
            last["events"] = [e.to_dict() for e in result.pipeline.events]
            return result

        trainer.stepper.run = keep_events
        records = trainer.train().records
        trainer.close()
        out.append({"events": last["events"], "records": records})
    return out


def stage_times(events_by_rank: list[list[dict]], pp: int, vp: int) -> tuple[list[float], list[float]]:
    """Mean forward and backward seconds per virtual stage (index chunk * pp + rank)."""
    fwd, bwd = [0.0] * (pp * vp), [0.0] * (pp * vp)
    for rank, events in enumerate(events_by_rank):
        for chunk in range(vp):
            for cat, table in (("forward", fwd), ("backward", bwd)):
                spans = [e["end"] - e["start"] for e in events if e["cat"] == cat and e["chunk"] == chunk]
                table[chunk * pp + rank] = statistics.mean(spans)
    return fwd, bwd


def replay_measured(lists, events_by_rank: list[list[dict]]) -> float:
    """Idle fraction of the schedule replayed with each action's own measured time (transfers
    free): unlike ``simulate`` with stage means, it keeps the step-to-step variation of the
    compute times, so the rest of the gap to the measurement is what the transfers cost."""
    from parallel.pipeline.schedules import replay
    took = {(rank, e["cat"][0], e["microbatch"], e["chunk"]): e["end"] - e["start"]
            for rank, events in enumerate(events_by_rank) for e in events
            if e["cat"] in ("forward", "backward")}
    times = replay(lists, lambda rank, a: took[(rank, a.kind.value, a.microbatch, a.chunk)])
    makespan = max(t[-1][1] for t in times if t)
    busy = sum(end - start for actions, spans in zip(lists, times)
               for a, (start, end) in zip(actions, spans) if not a.is_comm)
    return 1.0 - busy / (len(lists) * makespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the totals")
    parser.add_argument("--out", default="runs/bench", help="folder for the Gantt charts")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cores = os.cpu_count() or 1

    rows, charts = [], []
    for pp in args.pp:
        runs = []
        for m in args.m:
            for schedule, vp in SCHEDULES:
                if (schedule == "interleaved" and m % pp) or args.num_layers % (pp * vp):
                    continue
                flags = model_flags(args) + ["--pp", str(pp), "--pipeline-schedule", schedule,
                                             "--virtual-pipeline-size", str(vp),
                                             "--global-batch-size", str(m * args.micro_batch_size)]
                runs.append((schedule, m, vp, flags))
        results = run_distributed(run_rank, grid=RankGrid(pp=pp), args=(runs,), timeout_s=600)
        for i, (schedule, m, vp, _) in enumerate(runs):
            events = [results[rank][i]["events"] for rank in range(pp)]
            summary = summarize_run(results[0][i]["records"], args.warmup)
            fwd, bwd = stage_times(events, pp, vp)
            lists = build_schedule(schedule, pp, m, vp)
            sim = simulate(lists, fwd, bwd)
            last = measured_bubble(events)
            rows.append((schedule, pp, m, vp, theoretical_bubble(schedule, pp, m, vp),
                         summary["bubble_simulated"], summary["bubble_measured"],
                         sim.idle_fraction, replay_measured(lists, events), last.mean,
                         summary["step_time_s"], statistics.mean(fwd), statistics.mean(bwd)))
            stem = os.path.join(args.out, f"pipeline_{schedule}_p{pp}_m{m}")
            title = f"{schedule} p={pp} m={m} v={vp}"
            charts.append(draw_gantt(events, f"{stem}_measured.png",
                                     f"{title}: measured bubble {last.mean:.3f} (last step)"))
            charts.append(draw_gantt(sim, f"{stem}_simulated.png",
                                     f"{title}: simulated bubble {sim.idle_fraction:.3f}"))

    print("| schedule | p | m | v | theoretical | simulated | measured | abs(measured - simulated) "
          "| last step: simulated / each action's time / measured | step time (s) | mean F (ms) "
          "| mean B (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for schedule, pp, m, vp, theory, sim, meas, last_sim, last_each, last_meas, t, f, b in rows:
        print(f"| {schedule} | {pp} | {m} | {vp} | {theory:.3f} | {sim:.3f} | {meas:.3f} "
              f"| {abs(meas - sim):.3f} | {last_sim:.3f} / {last_each:.3f} / {last_meas:.3f} "
              f"| {t:.3f} | {f * 1e3:.1f} | {b * 1e3:.1f} |")
    print()
    print(f"Totals over steps {args.warmup + 1}..{args.steps} of each run ({args.warmup} warm-up "
          f"steps left out). simulated: the executed schedule replayed with each step's measured "
          f"mean forward/backward time per virtual stage, transfers free. measured: the "
          f"bubble_measured metric (transfers + idle before the first and after the last action, "
          f"over the pipeline phase). Last step: the replay with stage means, the replay with each "
          f"action's own measured time (what compute-time variation adds), and the measurement "
          f"(the rest is what the transfers cost).")
    if max(args.pp) > cores:
        print(f"note: this machine has {cores} CPU cores and runs up to {max(args.pp)} pipeline ranks, "
              f"so ranks wait for a core as well as for their neighbours: measured bubbles are "
              f"inflated by oversubscription, and the forward/backward times fed to the simulation "
              f"include that waiting. Compare the schedules with each other, not with the theory.")
    print(f"Gantt charts ({len(charts)}): {args.out}/pipeline_<schedule>_p<p>_m<m>_{{measured,simulated}}.png")


if __name__ == "__main__":
    main()
