"""What an aten op or a collective touches, and where the repository's code issued it: the
reading the stream-order checker (stream_check.py) charges to streams.

- ``plan(func)``: from an op's schema, once per op, the arguments it writes, reads or both and
  which returns are fresh; ``values`` picks those arguments out of a call, ``tensors`` the
  tensors of a value;
- ``collective_operands``: a collective's (reads, writes);
- ``byte_range``: the bytes of its storage a tensor (view) spans;
- ``site`` / ``origin``: the innermost frame of the repository's own code outside the checker,
  the stream API and the dispatch modes' hooks.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP_FILES = tuple(os.path.join(_HERE, name) for name in ("stream_check.py", "streams.py",
                                                           "op_accesses.py"))
_MODE_HOOKS = ("__torch_dispatch__", "__torch_function__")


def collective_operands(op: str, tensors: list) -> tuple[list, list]:
    """(reads, writes) of a collective: all-reduce, broadcast and a receive write their tensor,
    a send reads it, the others write the first tensor (the output) and read the rest."""
    if op in ("all_reduce", "broadcast", "recv"):
        return [], tensors
    if op == "send":
        return tensors, []
    return tensors[1:], tensors[:1]


def byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of its storage a tensor (view) spans; None when it has no elements."""
    numel = t.numel()
    if numel == 0:
        return None
    span = numel if t.is_contiguous() else \
        1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    elem, offset = t.element_size(), t.storage_offset()
    return offset * elem, (offset + span) * elem


def tensors(value) -> list:
    """The tensors of an op's argument or result (a tensor, or a list or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


_CODE_PATHS: dict = {}   # code object -> its path relative to the repository, or None


def _repo_path(code) -> str | None:
    """``code``'s file relative to the repository when it is the repository's own code outside the
    checker and the dispatch modes' hooks, else None (decided once per code object)."""
    try:
        return _CODE_PATHS[code]
    except KeyError:
        path = code.co_filename
        own = path.startswith(_ROOT) and path not in _SKIP_FILES and "/.venv/" not in path \
            and code.co_name not in _MODE_HOOKS
        _CODE_PATHS[code] = rel = os.path.relpath(path, _ROOT) if own else None
        return rel


def site() -> str | None:
    """The innermost frame of the repository outside the checker, the torch tree and any other
    dispatch mode (a counter of host syncs sees the op first), as ``path:line (function)``; None
    when there is none."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        rel = _repo_path(code)
        if rel is not None:
            return f"{rel}:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return None


def origin(op: str) -> str:
    """``op`` and where the repository's code issued it."""
    where = site()
    return op if where is None else f"{op} at {where}"


@dataclass(frozen=True)
class OpPlan:
    """What an op's schema says about its arguments, read once per op: (position, name, keyword
    only) of the arguments it writes (``alias_info.is_write``), of those it reads (no alias
    info; an aliasing, non-writing argument is a view's base: no access), of both (what
    ``check_allocated`` looks at: nothing for ``*_like`` and ``new_*``, which read only a shape),
    and which returns are fresh (no alias info)."""
    name: str
    written: tuple
    read: tuple
    read_or_written: tuple
    fresh_returns: tuple


_PLANS: dict = {}


def plan(func) -> OpPlan:
    plan = _PLANS.get(func)
    if plan is None:
        name = func.overloadpacket.__name__
        schema = func._schema
        written, read = [], []
        for i, arg in enumerate(schema.arguments):
            slot = (i, arg.name, arg.kwarg_only)
            info = arg.alias_info
            if info is not None and info.is_write:
                written.append(slot)
            elif info is None:
                read.append(slot)
        shape_only = name.endswith("_like") or name.startswith("new_")
        both = () if shape_only else tuple(sorted(written + read))
        plan = _PLANS[func] = OpPlan(name, tuple(written), tuple(read), both,
                                      tuple(r.alias_info is None for r in schema.returns))
    return plan


def values(slots: tuple, args: tuple, kwargs: dict):
    """The values of the arguments ``slots`` names (skipping the absent and None)."""
    for i, name, kwarg_only in slots:
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        if value is not None:
            yield value
