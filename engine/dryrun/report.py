"""What a dry run prints and writes: a table per role, the collectives, the planner's figures, a
summary, and the ``--json`` document.

JSON layout (bytes are integers, one object per role)::

    {"layout": {"world_size", "tp", "cp", "pp", "dp", "order", "micro_batches", "backend_rules",
                "precision", "precision_source", "tp_comm_overlap"},
     "roles": [{"name", "ranks", "stages", "representative", "param_bytes", "grad_bytes",
                "optimizer_state_bytes", "activation_bytes", "activation_bytes_by_stage",
                "in_flight", "comm_buffer_bytes", "total_bytes", "fits", "memory_by_dtype",
                "gathered_bytes", "optimizer_state_host_bytes", "grad_host_bytes",
                "comm": {kind: {"calls", "payload_bytes", "wire_bytes"}},
                "collectives": [{"op", "group", "dtype", "bytes", "counted"}, a recv with
                                "received_bytes" (its "bytes", the payload it hands over, are 0)],
                "overlap": [{"what", "ops", "group", "calls", "bytes", "overlapped", "how"}],
                "holds": {...}, "planner": [{"figure", "dry_run", "planner", "difference",
                "flagged", "why"}]}],
     "summary": {"largest_role", "largest_rank", "largest_total_bytes", "device_memory_bytes",
                 "usable_bytes", "ranks_that_do_not_fit", "bytes_per_step_by_group_kind",
                 "flagged", "notes", "seconds"}}
"""
from __future__ import annotations

import json
import math
from collections import Counter

from engine.dryrun.compare import TOLERANCE
from engine.dryrun.record import bytes_by_kind
from engine.dryrun.roles import describe_stages

GIB = 2 ** 30


def _unit(largest: float) -> tuple[str, int]:
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20)):
        if largest >= size:
            return unit, size
    return "KiB", 2 ** 10


def _gib(x, size: int = GIB) -> str:
    return "-" if x is None else f"{x / size:.2f}"


def _bytes(x) -> str:
    if x is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{int(x)} B"


def role_table(result) -> str:
    unit, size = _unit(max(result.total(r) for r in result.records))
    head = (f"{'role':<15}{'ranks':>6}  {'stages':<8}{'built':>6}{'params':>9}{'grads':>9}"
            f"{'optim':>9}{'activ':>9}{'buffers':>9}{'total':>9}  {unit}  in flight")
    lines = [head]
    for r in result.records:
        fits = "" if result.usable is None else ("  fits" if result.fits(r) else "  DOES NOT FIT")
        flight = ",".join(str(r.role.in_flight[s]) for s in r.role.stages)
        m = r.metrics
        cells = (m["param_bytes"], m["grad_bytes"], m["optimizer_state_bytes"], r.activation_bytes,
                 result.buffers(r), result.total(r))
        lines.append(f"{r.role.name:<15}{len(r.role.ranks):>6}  {describe_stages(r.role.stages):<8}"
                     f"{r.rank:>6}" + "".join(f"{_gib(c, size):>9}" for c in cells)
                     + f"       {flight}{fits}")
    return "\n".join(lines)


def memory_notes(result) -> list[str]:
    """Beside the role table: ZeRO-3's gathered units (in its total) and the offloaded optimizer's
    host memory (not in it), per role where there are any."""
    lines = []
    for r in result.records:
        m = r.memory
        if r.gathered_bytes:
            lines.append(f"  {r.role.name}: ZeRO-3 units gathered at once, at their peak: "
                         f"{_bytes(r.gathered_bytes)} (in the total)")
        if m["optimizer_state_host_bytes"]:
            lines.append(f"  {r.role.name}: host memory per rank (--optimizer-cpu-offload): "
                         f"optimizer {_bytes(m['optimizer_state_host_bytes'])}, gradient copies "
                         f"{_bytes(m['grad_host_bytes'])} (not in the total)")
    return lines


def collective_table(record) -> str:
    """The representative's step, grouped by (op, group, dtype): calls and payload bytes."""
    calls, total = Counter(), Counter()
    for c in record.collectives:
        key = (c["op"], c["group"], c["dtype"] or "-")
        calls[key] += 1
        total[key] += c.get("received_bytes", c["bytes"])  # a receive: what it landed
    lines = [f"  {record.role.name} (rank {record.rank}): {len(record.collectives)} collectives and "
             f"transfers in one step"]
    for key in sorted(calls):
        op, group, dtype = key
        lines.append(f"    {op:<15}{group:<10}{dtype:<10}{calls[key]:>6} x  {_bytes(total[key]):>12}"
                     + ("  received" if op == "recv" else ""))
    return "\n".join(lines)


def overlap_header(result) -> str:
    par, on = result.cfg.parallel, (lambda flag: "on" if flag else "off")  # noqa: E731
    return (f"overlapped with compute (--tp-comm-overlap {on(result.tp_comm_overlap)}, "
            f"--overlap-grad-reduce {on(par.overlap_grad_reduce)}, --overlap-param-gather "
            f"{on(par.overlap_param_gather and par.use_distributed_optimizer)}):")


def overlap_table(record, rows) -> str:
    """One role's step by overlap: what is hidden under compute, and how; what is exposed."""
    hidden = sum(r.calls for r in rows if r.overlapped)
    lines = [f"  {record.role.name} (rank {record.rank}): {hidden} of {sum(r.calls for r in rows)} "
             f"overlapped"]
    for r in rows:
        lines.append(f"    {r.what:<13}{r.group:<10}{r.ops:<37}{r.calls:>6} x {_bytes(r.bytes):>12}  "
                     f"{'overlapped' if r.overlapped else 'exposed':<11}{r.how}")
    return "\n".join(lines)


def comparison_table(name: str, rows) -> str:
    lines = [f"  {name}: dry run / planner"]
    for row in rows:
        d = row.difference
        diff = "-" if d is None else ("inf" if d == float("inf") else f"{100 * d:+.1f}%")
        flag = "  <-- " + row.why if row.flagged else ""
        lines.append(f"    {row.figure:<24}{_bytes(row.dry_run):>12}{_bytes(row.planner):>12}"
                     f"{diff:>9}{flag}")
    return "\n".join(lines)


def _fp8(cfg) -> str:
    """What the precision line adds under --fp8-format: the GEMMs' format and scales."""
    p = cfg.precision
    if not p.fp8_format:
        return ""
    return f"; FP8 GEMMs: --fp8-format {p.fp8_format} --fp8-recipe {p.fp8_recipe}"


def text(result) -> str:
    g = result.grid
    out = [f"gridtron dry run: {g.describe()} on the meta device, "
           f"{result.num_micro} micro-batches per step, collectives checked against "
           f"{result.rules or 'no backend rules'}",
           f"precision: {result.precision} ({result.precision_source}){_fp8(result.cfg)}",
           "", role_table(result)] + memory_notes(result) + ["", "collectives of one training step:"]
    out += [collective_table(r) for r in result.records]
    if result.overlaps:
        out += ["", overlap_header(result)]
        out += [overlap_table(r, rows) for r, rows in zip(result.records, result.overlaps)]
    if isinstance(result.comparison, str):
        out += ["", f"planner: no estimate ({result.comparison})"]
    else:
        out += ["", f"planner (differences above {100 * TOLERANCE:.0f}% flagged):"]
        out += [comparison_table(r.role.name, rows) for r, rows in zip(result.records,
                                                                        result.comparison)]
    s = summary(result)
    out += ["", f"largest rank: {s['largest_role']} (rank {s['largest_rank']}), "
            f"{_bytes(s['largest_total_bytes'])}"
            + ("" if result.usable is None else
               f" of {_gib(s['usable_bytes'])} GiB usable ({_gib(s['device_memory_bytes'])} GiB "
               f"device memory)")]
    if s["ranks_that_do_not_fit"]:
        out.append(f"DOES NOT FIT: {s['ranks_that_do_not_fit']} rank(s) need more than the usable "
                   f"memory")
    out.append("bytes per step by group kind, whole job: " + ", ".join(
        f"{k} {_bytes(v)}" for k, v in s["bytes_per_step_by_group_kind"].items() if v))
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)


def summary(result) -> dict:
    largest = max(result.records, key=result.total)
    by_kind = bytes_by_kind(result.records)
    flagged = [] if isinstance(result.comparison, str) else [
        f"{r.role.name}: {row.figure}" for r, rows in zip(result.records, result.comparison)
        for row in rows if row.flagged]
    return {"largest_role": largest.role.name, "largest_rank": largest.rank,
            "largest_total_bytes": result.total(largest),
            "device_memory_bytes": result.device_memory, "usable_bytes": result.usable,
            "ranks_that_do_not_fit": sum(len(r.role.ranks) for r in result.records
                                         if result.usable is not None and not result.fits(r)),
            "bytes_per_step_by_group_kind": by_kind, "flagged": flagged,
            "notes": list(result.notes), "seconds": round(sum(r.seconds for r in result.records), 2)}


def as_json(result) -> dict:
    g = result.grid
    roles = []
    for i, r in enumerate(result.records):
        m = r.memory
        entry = {"name": r.role.name, "ranks": list(r.role.ranks), "stages": list(r.role.stages),
                 "representative": r.rank, "param_bytes": m["param_bytes"],
                 "grad_bytes": m["grad_bytes"], "optimizer_state_bytes": m["optimizer_state_bytes"],
                 "activation_bytes": r.activation_bytes,
                 "activation_bytes_by_stage": {str(k): v for k, v in r.activation_per_stage.items()},
                 "in_flight": {str(k): v for k, v in r.role.in_flight.items()},
                 "comm_buffer_bytes": result.buffers(r), "total_bytes": result.total(r),
                 "fits": None if result.usable is None else result.fits(r),
                 "memory_by_dtype": {k: m[f"{k}_by_dtype"] for k in
                                     ("param_bytes", "grad_bytes", "optimizer_state_bytes")},
                 "gathered_bytes": r.gathered_bytes,
                 "optimizer_state_host_bytes": m["optimizer_state_host_bytes"],
                 "grad_host_bytes": m["grad_host_bytes"],
                 "comm": r.comm, "collectives": r.collectives, "holds": r.holds,
                 "overlap": [row.as_dict() for row in result.overlaps[i]] if result.overlaps else []}
        if not isinstance(result.comparison, str):
            entry["planner"] = [{"figure": row.figure, "dry_run": row.dry_run,
                                 "planner": row.planner, "difference": _finite(row.difference),
                                 "flagged": row.flagged, "why": row.why}
                                for row in result.comparison[i]]
        roles.append(entry)
    return {"layout": {"world_size": g.world_size, "tp": g.tp, "cp": g.cp, "pp": g.pp, "dp": g.dp,
                       "order": g.order, "micro_batches": result.num_micro,
                       "backend_rules": result.rules, "precision": result.precision,
                       "precision_source": result.precision_source,
                       "tp_comm_overlap": result.tp_comm_overlap},
            "roles": roles, "summary": summary(result)}


def _finite(x):
    return None if x is None or not math.isfinite(x) else x


def write_json(result, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(as_json(result), fh, indent=1)
