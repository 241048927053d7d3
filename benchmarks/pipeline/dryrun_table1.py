"""Dry runs of the layouts of Narayanan et al. 2021, Table 1 (1.7B to 1008B parameters on 32 to
3,072 GPUs), next to the planner's estimates for the same runs.

    python -m benchmarks.pipeline.dryrun_table1                 # all ten rows (about a minute or two)
    python -m benchmarks.pipeline.dryrun_table1 --rows 1.7B,39.1B

Each row is ``engine.dryrun`` of a GPT-2 model (vocabulary 51200, sequence 2048, fp16, full
recomputation, no sequence parallelism, no distributed optimizer, rank order tp-dp-pp) with the
row's tp, pp, virtual stages and micro-batch size from Megatron-LM's
examples/academic_paper_scripts/sc21/run_table_1.sh, on A100 80GB (NCCL rules and buffers). For
the rank with the most memory it prints what the dry run built and recorded, the planner's
estimate of the same run (this engine: fused attention, recomputation that stops early) and the
planner's estimate with Megatron 2021's options (materialised softmax, the whole forward
recomputed), which docs/planner.md's published check uses. The paper gives throughput per GPU for
these runs, no memory per GPU; its bound is the A100's 80 GB.

A second table gives, for the same rank, the bytes of one step per group kind: dry run (the
engine's own collectives) and planner (engine/plan/traffic.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the fake groups' harmless teardown warning
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config.cli import parse_args  # noqa: E402
from engine.dryrun import dry_run  # noqa: E402
from engine.plan.model import GIB, Layout, ModelShape  # noqa: E402
from engine.plan.memory import memory_per_device  # noqa: E402

ROWS = [  # name, (layers, hidden, heads), GPUs, batch, (tp, pp, vp, mbs): tests/engine/plan/test_plan.py PAPER
    ("1.7B", (24, 2304, 24), 32, 512, (1, 1, 1, 16)),
    ("3.6B", (30, 3072, 32), 64, 512, (2, 1, 1, 16)),
    ("7.5B", (36, 4096, 32), 128, 512, (4, 1, 1, 16)),
    ("18.4B", (40, 6144, 48), 256, 1024, (8, 1, 1, 8)),
    ("39.1B", (48, 8192, 64), 512, 1536, (8, 2, 1, 4)),
    ("76.1B", (60, 10240, 80), 1024, 1792, (8, 4, 3, 2)),
    ("145.6B", (80, 12288, 96), 1536, 2304, (8, 8, 2, 2)),
    ("310.1B", (96, 16384, 128), 1920, 2160, (8, 16, 2, 1)),
    ("529.6B", (105, 20480, 128), 2520, 2520, (8, 35, 3, 1)),
    ("1008.0B", (128, 25600, 160), 3072, 3072, (8, 64, 1, 1)),
]


def row_args(row) -> list[str]:
    _, (layers, hidden, heads), _, batch, (tp, pp, vp, mbs) = row
    args = ["--mock-data", "--vocab-size", "51200", "--seq-length", "2048", "--block", "gpt2",
            "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--global-batch-size", str(batch),
            "--micro-batch-size", str(mbs), "--tp", str(tp), "--pp", str(pp),
            "--precision", "fp16", "--recompute", "full", "--no-progress"]
    if vp > 1:
        args += ["--pipeline-schedule", "interleaved", "--virtual-pipeline-size", str(vp)]
    return args


def megatron_2021_gib(row) -> float:
    """The planner with the paper's software (docs/planner.md, the published check)."""
    _, (layers, hidden, heads), gpus, batch, (tp, pp, vp, mbs) = row
    shape = ModelShape(layers, hidden, heads, 51200, 2048, batch, recompute_early_stop=False)
    return memory_per_device(shape, Layout(tp, pp, gpus // (tp * pp), vp, mbs, "full"), "nccl").total / GIB


def run(rows) -> tuple[list[str], list[str]]:
    memory = ["| model | tp, pp, vp, mbs | GPUs | roles built (s) | largest rank | weights + grads + "
              "optimizer GiB | activations GiB | comm buffers GiB | total GiB | planner, same run GiB "
              "| planner, Megatron 2021 options GiB | published |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    traffic = ["| model | rank | tp dry run / planner GiB | pp | dp | embedding |",
               "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        start = time.perf_counter()
        result = dry_run(parse_args(row_args(row)), row[2], "a100-80gb")
        seconds = time.perf_counter() - start
        rec = max(result.records, key=result.total)
        rows_of = dict(zip([r.rank for r in result.records], result.comparison))[rec.rank]
        plan = {r.figure: r.planner for r in rows_of}
        m = rec.metrics
        states = m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"]
        planned = sum(plan[k] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes",
                                        "activation_bytes", "comm_buffer_bytes"))
        total = result.total(rec)
        tp, pp, vp, mbs = row[4]
        memory.append(
            f"| {row[0]} | {tp}, {pp}, {vp}, {mbs} | {row[2]} | {len(result.records)} ({seconds:.1f}) "
            f"| {rec.role.name} (rank {rec.rank}) | {states / GIB:.1f} | "
            f"{rec.activation_bytes / GIB:.1f} | {result.buffers(rec) / GIB:.2f} | {total / GIB:.1f} | "
            f"{planned / GIB:.1f} ({100 * (planned - total) / total:+.0f}%) | "
            f"{megatron_2021_gib(row):.1f} | none (fits in 80) |")
        cells = []
        for key, fig in (("tp_comm_bytes", "tp_comm_bytes"), ("pp_comm_bytes", "pp_comm_bytes"),
                         ("dp_comm_bytes", "dp_comm_bytes"), (None, "embedding_comm_bytes")):
            dry = m[key] if key else rec.comm["embedding"]["payload_bytes"]
            cells.append(f"{dry / GIB:.2f} / {plan[fig] / GIB:.2f}")
        traffic.append(f"| {row[0]} | {rec.rank} | " + " | ".join(cells) + " |")
        print(f"{row[0]}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return memory, traffic


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", help="comma list of model names (default: all)")
    args = p.parse_args(argv)
    rows = ROWS
    if args.rows:
        wanted = set(args.rows.split(","))
        rows = [r for r in ROWS if r[0] in wanted]
        if not rows:
            p.error(f"--rows: none of {sorted(wanted)} in {[r[0] for r in ROWS]}")
    memory, traffic = run(rows)
    print("\n".join(memory))
    print()
    print("\n".join(traffic))
    return 0


if __name__ == "__main__":
    sys.exit(main())
