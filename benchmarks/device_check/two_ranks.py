"""The device check's two-ranks stage: the first check of the real streams across ranks on a
machine with one accelerator.

NCCL refuses two ranks on one GPU (and HCCL two on one NPU), so the stage first probes gloo with
device tensors: two processes on the one device try each collective the layouts need
(all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, point-to-point), as one command
under its own deadline (``python -m benchmarks.device_check.two_ranks KIND DIR``: gloo may crash
or hang on device tensors, which then costs the probe, not the check; each rank writes what it
learnt after every op, and an op not reached is reported as such). Then each layout
whose collectives gloo ran is trained as two processes on that device
(``engine.train --distributed-backend gloo``), fp32, against the serial run of the same model on
the same device (one serial run per model: the dense one, and the MoE one for ``ep2``):

- ``dp2 zero``: dp 2, ZeRO-1 with the overlapped parameter gather (small buckets);
- ``tp2 sp``: tp 2 with sequence parallelism;
- ``pp2``: pp 2, 1F1B;
- ``ep2``: dp 2 with 4 experts (top-2) over ep 2 (the all-to-all dispatcher).

A layout passes when every step's loss is within docs/design.md's relative 1e-4 of the serial run's.
A layout that needs a collective gloo refused is reported with the collective and gloo's line; one
that needs a collective the probe never reached (the probe stopped at its deadline or crashed) is
"deadline" or "failed", as the stage is then: it checked nothing. A run stopped at its share of
the deadline is "deadline", not "failed"; on the CPU the stage is skipped (the test suite runs
every layout against serial there).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import read_jsonl
from benchmarks.device_check.plan import last_line

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
MOE = ("--num-experts", "4", "--moe-router-topk", "2")
LAYOUTS = {  # name: (the model's flags, the layout's flags, the collectives it needs)
    "dp2 zero": ((), ("--dp", "2", "--use-distributed-optimizer", "--overlap-param-gather",
                      "--bucket-size-mb", "0.01"), ("all_reduce", "all_gather", "reduce_scatter")),
    "tp2 sp": ((), ("--tp", "2", "--sequence-parallel"),
               ("all_reduce", "all_gather", "reduce_scatter")),
    "pp2": ((), ("--pp", "2", "--pipeline-schedule", "1f1b"), ("all_reduce", "p2p")),
    "ep2": (MOE, ("--dp", "2", "--ep", "2"), ("all_reduce", "all_to_all")),
}
REL = 1e-4
PROBE_S = 60.0    # the probe's deadline at most (a third of the stage's at most)


def _try(op: str, rank: int, device) -> None:
    import torch.distributed as dist
    x = torch.full((8,), float(rank + 1), device=device)
    if op == "all_reduce":
        dist.all_reduce(x)
        ok = bool((x == 3).all())
    elif op == "all_gather":
        out = torch.empty(16, device=device)
        dist.all_gather_into_tensor(out, x)
        ok = out[:8].eq(1).all().item() and out[8:].eq(2).all().item()
    elif op == "reduce_scatter":
        out = torch.empty(4, device=device)
        dist.reduce_scatter_tensor(out, x)
        ok = bool((out == 3).all())
    elif op == "all_to_all":
        out = torch.empty(8, device=device)
        dist.all_to_all_single(out, x)
        ok = out[:4].eq(1).all().item() and out[4:].eq(2).all().item()
    elif op == "broadcast":
        dist.broadcast(x, src=0)
        ok = bool((x == 1).all())
    else:
        peer = 1 - rank
        out = torch.empty(8, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer),
                                        dist.P2POp(dist.irecv, out, peer)])
        for w in works:
            w.wait()
        ok = bool((out == peer + 1).all())
    if not ok:  # (reading the result waited for the collective)
        raise RuntimeError("wrong result")


def _probe_rank(rank: int, kind: str, port: int, out_dir: str) -> None:
    """One of the probe's two processes: each op in turn, this rank's results written after each
    (a crash or a hang later leaves what was learnt); a group the last op broke ends the probe."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results, path = {}, Path(out_dir) / f"{rank}.json"
    for op in OPS:
        try:
            _try(op, rank, device)
            results[op] = None
        except Exception as exc:  # noqa: BLE001 - what gloo says is the result
            results[op] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        path.write_text(json.dumps(results))
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - the group is broken: the ops left are not probed
            break
    dist.destroy_process_group()


def _spawn_probe(kind: str, out_dir: str) -> None:
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_probe_rank, args=(kind, port, out_dir), nprocs=2, start_method="spawn")


def probe(kind: str, run_process, out: Path, deadline_s: float) -> tuple[dict, float]:
    """({op: None where gloo ran it with two processes on device 0 of ``kind``, else its line},
    wall seconds). The two processes are one command under ``deadline_s`` (``run_process``, as
    the layouts): gloo with device tensors may crash or hang a process, which costs the probe,
    not the check; an op a rank did not report is refused with how the probe ended."""
    results = out / "two_ranks_probe"
    results.mkdir(parents=True, exist_ok=True)
    for old in results.glob("*.json"):
        old.unlink()
    log = out / "two_ranks_probe.log"
    code, wall = run_process([sys.executable, "-m", "benchmarks.device_check.two_ranks", kind,
                              str(results)], log, deadline_s)
    ranks = [json.loads(f.read_text()) if f.exists() else {}
             for f in (results / f"{r}.json" for r in range(2))]
    ended = (f"the probe stopped at its {deadline_s:g} s deadline" if code is None else
             f"the probe ended (exit {code}: {last_line(log)})")
    found = {}
    for op in OPS:
        if all(op in r for r in ranks):
            found[op] = ranks[0][op] or ranks[1][op]
        else:
            found[op] = f"not probed: {ended}"
    return found, wall


NOT_PROBED = "not probed: "


def _refused(name: str, needs, refused: dict, kind: str) -> dict:
    """The row of a layout the probe did not clear: "refused" where gloo said no; where the probe
    never reached a collective it needs, "deadline" (the probe was stopped) or "failed" (it
    crashed): the layout is then unchecked, not shown to be impossible."""
    op = next(op for op in needs if refused[op])
    line = refused[op]
    if line.startswith(NOT_PROBED):
        status = "deadline" if line.startswith(NOT_PROBED + "the probe stopped") else "failed"
        return {"layout": name, "status": status, "loss_rel_diff": None, "note": f"{op} {line}"}
    return {"layout": name, "status": "refused", "loss_rel_diff": None,
            "note": f"gloo refuses {op} of {kind} tensors: {line}"}


def _losses(path: Path) -> list:
    return [r["loss"] for r in read_jsonl(path)] if path.exists() else []


def run_two_ranks(deadline_s: float, out: Path, kind: str, argv_for, run_process,
                  layouts: dict | None = None, refused: dict | None = None) -> dict:
    """The probe (or ``refused``, its result), then every layout of ``layouts`` (default all)
    gloo can run, each against the serial run of the same model (one serial run per distinct
    set of model flags: ep 2 trains an MoE model), within ``deadline_s``. ``argv_for(metrics,
    flags)``: engine.train's flags (the stage's model, fp32); ``run_process(cmd, log,
    deadline)``: (exit code or None, wall s). Each run's deadline is what is left of the
    stage's over the runs still to come (serial and two-rank runs alike), so time one run
    leaves goes to the next. Returns {"status", "detail", "probe", "rows", "wall_s"}; rows:
    {"layout", "status", "loss_rel_diff", "note"}."""
    layouts = LAYOUTS if layouts is None else layouts
    start = time.monotonic()
    if refused is None:
        refused, _ = probe(kind, run_process, out, min(PROBE_S, deadline_s / 3))
    end = start + deadline_s
    runs = [name for name, (_, _, needs) in layouts.items() if not any(refused[op] for op in needs)]
    models = list(dict.fromkeys(layouts[name][0] for name in runs))
    jobs_left = len(models) + len(runs)

    def launch(cmd: list[str], log: Path) -> int | None:
        nonlocal jobs_left
        share = max(1.0, (end - time.monotonic()) / max(1, jobs_left))
        jobs_left -= 1
        return run_process(cmd, log, share)[0]

    serial: dict[tuple, tuple] = {}   # model flags -> (exit code, losses, its log's name)
    rows = []
    for name, (model, flags, needs) in layouts.items():
        if name not in runs:
            rows.append(_refused(name, needs, refused, kind))
            continue
        if model not in serial:
            tag = "two_ranks_serial" + "".join(f"_{f.lstrip('-')}" for f in model)
            metrics = out / f"{tag}.jsonl"
            metrics.unlink(missing_ok=True)
            code = launch([sys.executable, "-m", "engine.train", *argv_for(str(metrics), model)],
                          out / f"{tag}.log")
            serial[model] = (code, _losses(metrics) if code == 0 else [], f"{tag}.log")
        code, want, log_name = serial[model]
        if not want:
            rows.append({"layout": name, "status": "deadline" if code is None else "failed",
                         "loss_rel_diff": None,
                         "note": "the serial run stopped at its deadline" if code is None else
                         f"the serial run failed ({log_name})"})
            continue
        tag = f"two_ranks_{name.replace(' ', '_')}"
        metrics = out / f"{tag}.jsonl"
        metrics.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "engine.train", *argv_for(str(metrics), ("--distributed-backend", "gloo",
                                                                    *model, *flags))]
        code = launch(cmd, out / f"{tag}.log")
        got = _losses(metrics)
        diff = max((abs(g - w) / abs(w) for g, w in zip(got, want)), default=None)
        ok = code == 0 and len(got) == len(want) and diff is not None and diff <= REL
        note = "" if ok else ("stopped at its deadline" if code is None else
                              f"exit {code}, {len(got)} of {len(want)} steps" if code or
                              len(got) != len(want) else f"losses differ by more than {REL:g}")
        status = "ok" if ok else "deadline" if code is None else "failed"
        rows.append({"layout": name, "status": status, "loss_rel_diff": diff, "note": note})
    bad = [r for r in rows if r["status"] in ("failed", "deadline")]
    status = "failed" if any(r["status"] == "failed" for r in bad) else "deadline" if bad else "ok"
    detail = "; ".join(f"{r['layout']}: {r['note']}" for r in bad)
    if not runs and not bad:
        detail = "gloo runs no layout's collectives on this device"
    return {"status": status, "detail": detail, "probe": refused, "rows": rows,
            "wall_s": time.monotonic() - start}


if __name__ == "__main__":  # the probe: python -m benchmarks.device_check.two_ranks KIND DIR
    _spawn_probe(sys.argv[1], sys.argv[2])
