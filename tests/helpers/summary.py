"""The closing summary table read back: each row's value, its continuation lines joined."""
from __future__ import annotations


def summary_cells(summary: str) -> dict[str, str]:
    """``{row name: value}`` of a summary table (engine/observe/metrics.py ``summary_table``); a
    value wrapped over continuation lines (an empty first cell) is joined with single spaces."""
    rows: dict[str, str] = {}
    last = None
    for line in summary.splitlines():
        if not line.startswith("| "):
            continue
        key, value = (part.strip() for part in line.split("|")[1:3])
        if key:
            rows[key], last = value, key
        elif last is not None:
            rows[last] += " " + value
    return rows
