"""The user-settable config fields (one table for the command line and YAML recipes).

``field_table()`` lists every field of the config's sections (engine/config/schema.py) with its
type, whether it may be null and its default; ``flag_info`` adds how the flag is presented
(engine/config/flags.py); ``suggest`` names the flag a user most likely meant.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing

from engine.base import FieldInfo
from engine.config.flags import FLAGS, Flag
from engine.config.parallel import ParallelConfig
from engine.config.schema import (CheckpointConfig, CompressionConfig, DataConfig, LogConfig, OptimConfig,
                                  PrecisionConfig, RunConfig)
from models.config import GPTConfig

SECTIONS = {"model": GPTConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "precision": PrecisionConfig, "data": DataConfig, "compression": CompressionConfig,
            "checkpoint": CheckpointConfig, "log": LogConfig}
TOP_LEVEL = ("device", "compile", "seed")
NOT_FLAGS = {("model", "seed")}  # the run's --seed feeds the model's initializer


def _type_of(tp) -> tuple[type, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        base, _ = _type_of(args[0])
        return base, len(args) < len(typing.get_args(tp))
    return (origin or tp), False


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def field_table() -> dict[str, FieldInfo]:
    """Every config field a user can set, by name."""
    table = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) not in NOT_FLAGS:
                tp, optional = _type_of(hints[f.name])
                table[f.name] = FieldInfo(section, tp, optional, _default(f))
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if f.name in TOP_LEVEL:
            tp, optional = _type_of(hints[f.name])
            table[f.name] = FieldInfo(None, tp, optional, _default(f))
    return table


def flag_info(name: str) -> Flag:
    return FLAGS.get(name) or Flag("", "training")


def _adds_a_word(unknown: str, candidate: str) -> bool:
    """Whether ``unknown`` has a word that is no spelling of one of ``candidate``'s (close, or its
    letters swapped), nor, 4 letters or more, a run of its letters (``numlayers``): a name that says
    more than the candidate (``--eval-global-batch-size``, ``--mtp-num-layers``, ``--log-progress``
    for ``--no-progress``) names another setting, not a misspelling of it."""
    theirs = candidate.split("-")

    def spelt(w):
        return (len(w) >= 4 and w in candidate.replace("-", "")) or any(
            sorted(w) == sorted(t) or difflib.SequenceMatcher(None, w, t).ratio() >= 0.75
            for t in theirs)
    return not all(spelt(w) for w in unknown.split("-"))


def suggest(unknown: str, candidates: dict[str, str]) -> str | None:
    """The flag a user most likely meant, or None when no candidate is clearly it.

    ``candidates`` maps option names (without dashes) to their field; a suggestion is a close
    spelling (difflib ratio >= 0.8) sharing a word with ``unknown`` and adding none of its own, or
    the one field that ``unknown`` is a prefix of. Short names (tp, pp, ...) are only suggested when
    typed exactly.
    """
    u = unknown.lstrip("-").replace("_", "-").lower()
    if not u:
        return None
    words = set(u.split("-"))
    names = [c for c in candidates if len(c) >= 4]
    for c in difflib.get_close_matches(u, names, n=5, cutoff=0.8):
        if _adds_a_word(u, c):
            continue
        if words & set(c.split("-")) or difflib.SequenceMatcher(None, u, c).ratio() >= 0.9:
            return c
    prefixed = {candidates[c] for c in names if c.startswith(u) and len(u) >= 4}
    if len(prefixed) == 1:
        return next(prefixed.__iter__()).replace("_", "-")
    return None
