"""Chrome-trace timeline of a training step: one track per rank, loadable by Perfetto.

Every rank records ``TimelineEvent``s (forward, backward, transfer waits from the executor; the
trainer adds its own, e.g. the optimizer step) with wall-clock times, so events of different
processes on one host line up. ``gather_events`` collects them on rank 0 with ``gather_object`` over
the default group (one collective, no files to merge); ``write_chrome_trace`` writes
``{"traceEvents": [...]}`` with complete ("X") events in microseconds. Events of category
``INSTANT_CATS`` ("sync": where the host waited for the device, engine/device/syncs.py) are
instants ("i", a marker on the rank's track), not spans.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

INSTANT_CATS = ("sync",)


@dataclass
class TimelineEvent:
    rank: int                 # global rank (one track each)
    name: str                 # e.g. "F3.1" (forward of micro-batch 3, chunk 1) or "optimizer"
    cat: str                  # "forward", "backward", "comm", "optimizer", ...
    start: float              # seconds since the epoch (time.time() based)
    end: float
    microbatch: int = -1
    chunk: int = 0
    args: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _as_dict(event) -> dict:
    if isinstance(event, dict):
        return dict(event)
    return event.to_dict() if hasattr(event, "to_dict") else dict(vars(event))


def gather_events(ps, events) -> list[list[dict]] | None:
    """Every rank's events on global rank 0 (``None`` elsewhere); collective over the world.

    Events travel as plain dicts, through an all-gather of objects (HCCL has no ``gather``).
    """
    mine = [_as_dict(e) for e in events]
    gathered = ps.world_group.all_gather_object(mine)
    return gathered if ps.rank == 0 else None


def chrome_trace(events_by_rank, labels: dict[int, str] | None = None) -> dict:
    """The trace as a dict: "X" events with ts/dur in microseconds from the earliest event."""
    flat = [_as_dict(e) for rank_events in events_by_rank for e in (rank_events or [])]
    origin = min((e["start"] for e in flat), default=0.0)
    trace = []
    for rank in sorted({e["rank"] for e in flat}):
        label = (labels or {}).get(rank, f"rank {rank}")
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": label}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"sort_index": rank}})
    for e in sorted(flat, key=lambda e: (e["rank"], e["start"])):
        args = dict(e.get("args") or {})
        if e.get("microbatch", -1) >= 0:
            args.update(microbatch=e["microbatch"], chunk=e.get("chunk", 0))
        ts = round((e["start"] - origin) * 1e6, 3)
        if e["cat"] in INSTANT_CATS:
            trace.append({"name": e["name"], "cat": e["cat"], "ph": "i", "s": "t", "pid": 0,
                          "tid": e["rank"], "ts": ts, "args": args})
            continue
        trace.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": 0, "tid": e["rank"],
                      "ts": ts, "dur": round(max(0.0, e["end"] - e["start"]) * 1e6, 3),
                      "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, events_by_rank, labels: dict[int, str] | None = None) -> dict:
    """Write the trace JSON (atomically: a temporary file renamed into place) and return it."""
    trace = chrome_trace(events_by_rank, labels)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    os.replace(tmp, path)
    return trace
