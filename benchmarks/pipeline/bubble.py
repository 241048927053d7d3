"""Pipeline bubble of every schedule through the real trainer: theory, simulation and measurement
side by side with throughput and activation memory, and a Gantt chart per run.

    python -m benchmarks.pipeline.bubble                       # pp 2 and 4, m 4 and 8
    python -m benchmarks.pipeline.bubble --pp 2 --m 4 8 --schedules 1f1b zb-h1 zb-v --steps 12

For every (pp, m) one spawned group of pp gloo processes (tp=dp=1, one thread per rank) builds a
trainer per schedule (GPipe, 1F1B, interleaved with 2 chunks, 1F1B with W actions, ZB-H1, ZB-V)
and runs their steps alternately: step 1 of every schedule, then step 2 of every schedule, ... so
a change of load on a shared machine hits all of them alike. Per run it prints:

- theoretical: the closed form for equal stages (parallel/pipeline/bubble.py; F, B, W equal for
  the zero-bubble schedules);
- simulated, free transfers: ``bubble.simulate`` replaying the very schedule the executor ran, with
  each virtual stage's mean forward, backward (B) and W device time measured from the events,
  transfers free, per step; totals over the measured steps (``bubble_simulated_compute``);
- simulated: the same replay with the measured transfers too, each stage's post time per transfer
  and mean receive latency per direction (parallel/pipeline/transfers.py; the trainer's
  ``bubble_simulated``);
- measured: the ``bubble_measured`` metric: per rank the device time in pipeline transfers plus the
  idle before its first and after its last action, over the pipeline phase; averaged over ranks;
  totals over the measured steps (idle time over pipeline time);
- exposed: ``time_pp_exposed_s``, seconds per step a rank's compute waited on transfers already on
  their way (posting, and waits after both sides posted), mean over ranks, and that over the
  forward/backward phase;
- tokens/s: all tokens over all step seconds of the measured steps, and the ratio to 1F1B's;
- peak activation MiB (2^20 bytes): the most bytes of activations held at once on any rank during the last
  step (benchmarks/memory/activation.py: autograd's saved tensors and what W closures keep);
- for the last step, the replay with stage means and measured transfers, the replay with each
  action's own measured time and each message's stage latency, and the measurement; the mean F,
  B and W times.

The first ``--warmup`` steps of every run are left out. Two PNG Gantt charts per run go to
``--out`` (the measured last step and the simulation; W blocks orange). On a machine with fewer
cores than pipeline ranks the processes share cores, so measured times include waiting for a
core; the script says so when it detects it.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import BenchParser, at_least, steps_past_warmup  # noqa: E402
from benchmarks.memory.activation import ActivationMemory  # noqa: E402
from benchmarks.pipeline.gantt import draw_gantt  # noqa: E402
from engine.config.cli import parse_args  # noqa: E402
from engine.observe.metrics import summarize_run  # noqa: E402
from engine.training.trainer import Trainer  # noqa: E402
from parallel.pipeline.bubble import (COMPUTE_CATS, measured_bubble, simulate,  # noqa: E402
                                      theoretical_bubble)
from parallel.pipeline.schedules import (SCHEDULES, build_schedule, chunks_per_rank,  # noqa: E402
                                         has_weight_actions, replay)
from parallel.pipeline.transfers import exposure  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402


def model_flags(args) -> list[str]:
    return ["--mock-data", "--vocab-size", "1024", "--no-progress", "--device", "cpu",
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(args.steps),
            "--lr-warmup-iters", "0", "--peak-tflops", "1"]


def run_rank(ps, runs: list[tuple[str, int, int, list[str]]], steps: int) -> list[dict]:
    """Build a trainer per (schedule, m, vp, flags) and run their steps alternately; keep this
    rank's records, the last step's events and its peak activation bytes."""
    trainers = [Trainer(parse_args(flags)) for *_, flags in runs]
    out = [{"records": [], "events": None, "peak": None} for _ in runs]
    for step in range(steps):
        for trainer, slot in zip(trainers, out):
            if step == steps - 1:
                run, tracker = trainer.stepper.run, ActivationMemory()

                def keep(batches, lr, run=run, slot=slot):
                    result = run(batches, lr)
                    slot["events"] = [e.to_dict() for e in result.pipeline.events]
                    slot["spans"] = result.pipeline.transfer_spans
                    return result
                trainer.stepper.run = keep
                with tracker.watch(trainer):
                    record = trainer.train_one(step)
                trainer.stepper.run = run
                slot["peak"] = tracker.peak_bytes
            else:
                record = trainer.train_one(step)
            slot["records"].append(record)
    for trainer in trainers:
        trainer.flush()  # the last step's timings and bubble (records are filled in place)
        trainer.close()
    return out


def stage_times(events_by_rank: list[list[dict]], pp: int, vp: int) -> dict[str, list[float]]:
    """Mean forward, backward and W seconds per (rank, chunk), indexed chunk * pp + rank."""
    table = {cat: [0.0] * (pp * vp) for cat in COMPUTE_CATS}
    for rank, events in enumerate(events_by_rank):
        for chunk in range(vp):
            for cat in COMPUTE_CATS:
                spans = [e["end"] - e["start"] for e in events
                         if e["cat"] == cat and e["chunk"] == chunk]
                table[cat][chunk * pp + rank] = statistics.mean(spans) if spans else 0.0
    return table


def replay_measured(lists, events_by_rank: list[list[dict]], costs) -> float:
    """Idle fraction of the schedule replayed with each action's own measured time and the
    measured transfer costs (``costs``: transfers.StageTransfers): unlike ``simulate`` with stage
    means, it keeps the step-to-step variation of the compute times."""
    took = {(rank, e["cat"][0], e["microbatch"], e["chunk"]): e["end"] - e["start"]
            for rank, events in enumerate(events_by_rank) for e in events if e["cat"] in COMPUTE_CATS}
    times = replay(lists, lambda rank, a: took[(rank, a.kind.value, a.microbatch, a.chunk)],
                   *costs.costs(lists))
    makespan = max(end for spans in times for _, end in spans)
    busy = sum(end - start for actions, spans in zip(lists, times)
               for a, (start, end) in zip(actions, spans) if not a.is_comm)
    return 1.0 - busy / (len(lists) * makespan)


def plan_runs(args, pp: int) -> list[tuple[str, int, int, list[str]]]:
    runs = []
    for m in args.m:
        for schedule in args.schedules:
            vp = 2 if schedule == "interleaved" else 1
            chunks = chunks_per_rank(schedule, vp)
            if (schedule == "interleaved" and m % pp) or args.num_layers % (pp * chunks):
                continue
            flags = model_flags(args) + ["--pp", str(pp), "--pipeline-schedule", schedule,
                                         "--virtual-pipeline-size", str(vp),
                                         "--global-batch-size", str(m * args.micro_batch_size)]
            runs.append((schedule, m, vp, flags))
    return runs


PEAK_HEADER = "peak activations (MiB)"   # the figure is bytes / 2**20
MIB = 2 ** 20


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the totals")
    parser.add_argument("--out", default="runs/bench", help="folder for the Gantt charts")
    args = parser.parse_args(argv)
    at_least(parser, args, pp=2, m=1, num_layers=1, hidden_size=1, seq_length=1,
             micro_batch_size=1, warmup=0)
    steps_past_warmup(parser, args, "the figures are totals")
    os.makedirs(args.out, exist_ok=True)
    cores = os.cpu_count() or 1

    rows, charts = [], []
    for pp in args.pp:
        runs = plan_runs(args, pp)
        results = run_distributed(run_rank, grid=RankGrid(pp=pp), args=(runs, args.steps),
                                  timeout_s=1800)
        base = {}
        for i, (schedule, m, vp, _) in enumerate(runs):
            events = [results[rank][i]["events"] for rank in range(pp)]
            summary = summarize_run(results[0][i]["records"], args.warmup)
            chunks = chunks_per_rank(schedule, vp)
            times = stage_times(events, pp, chunks)
            lists = build_schedule(schedule, pp, m, vp)
            split = has_weight_actions(lists)
            costs = exposure(lists, [results[rank][i]["spans"] for rank in range(pp)]).stages
            sim = simulate(lists, times["forward"], times["backward"], costs.costs(lists)[0],
                           times["weight"] if split else None, costs.costs(lists)[1])
            last = measured_bubble(events)
            peak = max(results[rank][i]["peak"] for rank in range(pp))
            if schedule == "1f1b":
                base[m] = summary["tokens_per_s"]
            rows.append({"schedule": schedule, "pp": pp, "m": m, "v": chunks,
                         "theory": theoretical_bubble(schedule, pp, m, vp),
                         "sim": summary["bubble_simulated"], "meas": summary["bubble_measured"],
                         "sim_free": summary["bubble_simulated_compute"],
                         "exposed": summary["time_pp_exposed_s"],
                         "phase_s": summary["time_forward_backward_s"],
                         "tokens_per_s": summary["tokens_per_s"], "peak_mib": peak / MIB,
                         "last": (sim.idle_fraction, replay_measured(lists, events, costs),
                                  last.mean),
                         "f": statistics.mean(times["forward"]), "b": statistics.mean(times["backward"]),
                         "w": statistics.mean(times["weight"]) if split else None})
            stem = os.path.join(args.out, f"pipeline_{schedule}_p{pp}_m{m}")
            title = f"{schedule} p={pp} m={m} v={chunks}"
            charts.append(draw_gantt(events, f"{stem}_measured.png",
                                     f"{title}: measured bubble {last.mean:.3f} (last step)"))
            charts.append(draw_gantt(sim, f"{stem}_simulated.png",
                                     f"{title}: simulated bubble {sim.idle_fraction:.3f}"))
        for row in rows:
            if row["pp"] == pp:
                row["vs_1f1b"] = (row["tokens_per_s"] / base[row["m"]]) if row["m"] in base else None

    print("| schedule | p | m | v | theoretical | simulated, free transfers | simulated "
          "| measured | measured - simulated | exposed PP transfers (ms/step, share of phase) "
          f"| tokens/s | vs 1F1B | {PEAK_HEADER} "
          "| last step: simulated / each action's time / measured | mean F / B / W (ms) |")
    print("| --- " * 15 + "|")
    for r in rows:
        w = f"{r['w'] * 1e3:.1f}" if r["w"] is not None else "-"
        ratio = f"{r['vs_1f1b']:.2f}" if r.get("vs_1f1b") is not None else "-"
        s, e, ms = r["last"]
        share = r["exposed"] / r["phase_s"] if r["phase_s"] else 0.0
        print(f"| {r['schedule']} | {r['pp']} | {r['m']} | {r['v']} | {r['theory']:.3f} "
              f"| {r['sim_free']:.3f} | {r['sim']:.3f} | {r['meas']:.3f} "
              f"| {r['meas'] - r['sim']:+.3f} | {r['exposed'] * 1e3:.1f} ({share:.3f}) "
              f"| {r['tokens_per_s']:.0f} | {ratio} "
              f"| {r['peak_mib']:.1f} | {s:.3f} / {e:.3f} / {ms:.3f} "
              f"| {r['f'] * 1e3:.1f} / {r['b'] * 1e3:.1f} / {w} |")
    print()
    print(f"Totals over steps {args.warmup + 1}..{args.steps} of each run ({args.warmup} warm-up "
          f"steps left out), the schedules of one (p, m) run step by step in turn in one process "
          f"group. simulated: the executed schedule replayed with each step's measured mean "
          f"F/B/W time per stage and its measured transfers (post time, receive latency per "
          f"stage and direction); free transfers: the same replay with transfers costing "
          f"nothing. exposed: time_pp_exposed_s (mean over ranks). measured: the bubble_measured metric "
          f"(transfers + idle before the first and after the last action, over the pipeline "
          f"phase). Peak activations: the most bytes held at once by autograd's saved tensors and "
          f"W closures on any rank, last step.")
    if max(args.pp) > cores:
        print(f"note: this machine has {cores} CPU cores and runs up to {max(args.pp)} pipeline ranks, "
              f"so ranks wait for a core as well as for their neighbours: measured bubbles are "
              f"inflated by oversubscription, and the forward/backward times fed to the simulation "
              f"include that waiting. Compare the schedules with each other, not with the theory.")
    print(f"Gantt charts ({len(charts)}): {args.out}/pipeline_<schedule>_p<p>_m<m>_{{measured,simulated}}.png")


if __name__ == "__main__":
    main()
