"""Switches that live on modules: set one attribute on every submodule that has it."""
from __future__ import annotations


def set_where_present(modules, attr: str, value) -> int:
    """Set ``attr`` to ``value`` on every submodule of ``modules`` (a module or a list of them)
    that has it; returns how many."""
    count = 0
    for module in (modules if isinstance(modules, (list, tuple)) else [modules]):
        for m in module.modules():
            if hasattr(m, attr):
                setattr(m, attr, value)
                count += 1
    return count
