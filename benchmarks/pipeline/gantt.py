"""Gantt charts of pipeline schedules, in the style of the Megatron-LM paper's figures.

One row per pipeline rank (stage 0 on top), a block per forward (blue), backward (green; the input
gradient B in a zero-bubble schedule) and weight-gradient W (orange, zero-bubble schedules) with
its micro-batch number, lighter shades for later model chunks (an interleaved schedule's, or zb-v's
way back up), and the idle time (the bubble) hatched in grey. Input is a ``bubble.SimResult`` (a simulated schedule) or
executor events (``TimelineEvent``s or dicts, one list per rank or flat with ``rank``)::

    python -m benchmarks.pipeline.gantt --schedule interleaved --pp 4 --m 8 --vp 2 --out gantt.png
"""
from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

_FWD = ["#1f5fa8", "#5b8fd1", "#9dbbe6", "#c7d8f0"]
_BWD = ["#2c8a3c", "#5fb56e", "#97d3a2", "#c5e8cb"]
_WGT = ["#d9730d", "#f0a04b", "#f6c68d", "#fbe0c0"]
_PALETTE = {"f": _FWD, "b": _BWD, "w": _WGT}
_CATS = {"forward": "f", "backward": "b", "weight": "w"}


def _blocks(source) -> tuple[list[list[tuple]], float]:
    """Rows of (kind, micro, chunk, start, end) per track, times from 0, and the makespan."""
    if hasattr(source, "timings"):                          # SimResult
        rows = [[(a.kind.value, a.microbatch, a.chunk, s, e) for a, s, e in spans
                 if a.kind.value in _PALETTE] for spans in source.timings]
        return rows, source.makespan
    events = list(source)
    if events and not isinstance(events[0], (list, tuple)):
        get = (lambda e, k: e[k]) if isinstance(events[0], dict) else getattr
        ranks = sorted({get(e, "rank") for e in events})
        events = [[e for e in events if get(e, "rank") == r] for r in ranks]
    rows, origin, end = [], float("inf"), 0.0
    for rank_events in events:
        row = []
        for e in rank_events:
            get = (lambda k: e[k]) if isinstance(e, dict) else (lambda k: getattr(e, k))
            origin, end = min(origin, get("start")), max(end, get("end"))
            cat = _CATS.get(get("cat"))
            if cat:
                row.append((cat, get("microbatch"), get("chunk"), get("start"), get("end")))
        rows.append(row)
    if origin == float("inf"):
        origin = 0.0
    rows = [[(k, m, c, s - origin, e - origin) for k, m, c, s, e in row] for row in rows]
    return rows, end - origin


def draw_gantt(source, path: str, title: str = "", show_numbers: bool = True) -> str:
    """Draw the chart to ``path`` (PNG, PDF or SVG by extension) and return the path."""
    rows, makespan = _blocks(source)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.35 * sum(len(r) for r in rows[:1]) + 4),
                                    0.55 * len(rows) + 1.4))
    for y, row in enumerate(rows):
        ax.broken_barh([(0, makespan)], (y - 0.4, 0.8), facecolors="#eeeeee",
                       hatch="///", edgecolor="#bbbbbb", linewidth=0)
        for kind, micro, chunk, start, end in row:
            palette = _PALETTE[kind]
            ax.broken_barh([(start, end - start)], (y - 0.4, 0.8),
                           facecolors=palette[min(chunk, len(palette) - 1)],
                           edgecolor="white", linewidth=0.6)
            if show_numbers and end - start > 0.015 * makespan:
                ax.text((start + end) / 2, y, str(micro), ha="center", va="center",
                        fontsize=7, color="white" if chunk < 2 else "black")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan if makespan > 0 else 1)
    ax.set_xlabel("time")
    handles = [Patch(color=_FWD[0], label="forward"), Patch(color=_BWD[0], label="backward")]
    if any(kind == "w" for row in rows for kind, *_ in row):
        handles.append(Patch(color=_WGT[0], label="weight gradients (W)"))
    handles.append(Patch(facecolor="#eeeeee", hatch="///", edgecolor="#bbbbbb", label="idle"))
    ax.legend(handles=handles, loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(rows) < 4 else -0.18), ncol=len(handles),
              frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main() -> None:
    from parallel.pipeline.bubble import simulate, theoretical_bubble
    from parallel.pipeline.schedules import SCHEDULES, build_schedule, chunks_per_rank, has_weight_actions

    parser = argparse.ArgumentParser(description="Draw a simulated pipeline schedule")
    parser.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--vp", type=int, default=1)
    parser.add_argument("--bwd-ratio", type=float, default=2.0,
                        help="backward / forward time (split into equal B and W for zero-bubble)")
    parser.add_argument("--out", default="gantt.png")
    args = parser.parse_args()
    lists = build_schedule(args.schedule, args.pp, args.m, args.vp)
    v = chunks_per_rank(args.schedule, args.vp)
    split = has_weight_actions(lists)
    bwd = args.bwd_ratio / v / (2 if split else 1)
    sim = simulate(lists, 1.0 / v, bwd, wgt_time=bwd if split else None)
    theory = theoretical_bubble(args.schedule, args.pp, args.m, args.vp)
    title = (f"{args.schedule} p={args.pp} m={args.m} v={args.vp}: bubble "
             f"{sim.idle_fraction:.3f} (theory {theory:.3f})")
    print(draw_gantt(sim, args.out, title))


if __name__ == "__main__":
    main()
