"""Command line and YAML recipes for ``python -m engine.train``.

Flags are generated from the config dataclasses (``--num-layers`` for ``num_layers``); help, group,
choices and Megatron-LM's spellings come from the table in engine/flags.py, defaults from the
dataclasses. A YAML recipe (``--config``, engine/recipe.py) uses the same keys, flat or grouped in
the config's own sections; flags given on the command line override it. Unknown flags and keys are
errors that name the intended flag when the intent is clear, and Megatron flags that have no
equivalent here are answered with what to do instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing

from engine.config import (CheckpointConfig, CompressionConfig, DataConfig, LogConfig, OptimConfig,
                           ParallelConfig, PrecisionConfig, RunConfig)
from engine.flags import CONSTANTS, FLAGS, GROUPS, MEGATRON_ANSWERS, Flag
from models.config import GPTConfig

SECTIONS = {"model": GPTConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "precision": PrecisionConfig, "data": DataConfig, "compression": CompressionConfig,
            "checkpoint": CheckpointConfig, "log": LogConfig}
TOP_LEVEL = ("device", "compile", "seed")
NOT_FLAGS = {("model", "seed")}  # the run's --seed feeds the model's initializer
HELP_HINT = "python -m engine.train --help lists every flag"


class ConfigError(ValueError):
    """A bad flag, recipe key or value; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    section: str | None  # None: a RunConfig field
    type: type           # int, float, str, bool, dict or list
    optional: bool
    default: object


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


def option_name(name: str) -> str:
    return f"--{name.replace('_', '-')}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + exit
        raise ConfigError(f"{message} ({HELP_HINT})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine.train", description=__doc__,
                     usage="%(prog)s [--config FILE] [--FLAG VALUE ...]",
                     argument_default=argparse.SUPPRESS, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe; flags override its keys")
    groups = {g: parser.add_argument_group(g) for g in GROUPS}
    table = field_table()
    for name, info in table.items():
        flag = flag_info(name)
        group = groups.get(flag.group, groups["training"])
        flags = [option_name(name)] + list(flag.aliases)
        shown = flag.default_text or ("none" if info.default is None else info.default)
        text = f"{flag.help} (default: {shown})"
        if info.type is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=text)
        elif info.type is dict:
            group.add_argument(*flags, dest=name, type=json.loads, metavar="JSON", help=text)
        elif info.type is list:
            group.add_argument(*flags, dest=name, nargs="+", metavar="ITEM", help=text)
        else:
            metavar = None if flag.choices else {int: "N", float: "X"}.get(info.type, name.upper())
            group.add_argument(*flags, dest=name, type=info.type, choices=flag.choices,
                               metavar=metavar, help=text)
    for option, (name, value, text, group) in CONSTANTS.items():
        if name in table:
            groups[group].add_argument(option, dest=name, action="store_const", const=value, help=text)
    return parser


def suggest(unknown: str, candidates: dict[str, str]) -> str | None:
    """The flag a user most likely meant, or None when no candidate is clearly it.

    ``candidates`` maps option names (without dashes) to their field; a suggestion is a close
    spelling (difflib ratio >= 0.8) sharing a word with ``unknown``, or the one field that
    ``unknown`` is a prefix of. Short names (tp, pp, ...) are only suggested when typed exactly.
    """
    u = unknown.lstrip("-").replace("_", "-").lower()
    if not u:
        return None
    words = set(u.split("-"))
    names = [c for c in candidates if len(c) >= 4]
    for c in difflib.get_close_matches(u, names, n=5, cutoff=0.8):
        if words & set(c.split("-")) or difflib.SequenceMatcher(None, u, c).ratio() >= 0.9:
            return c
    prefixed = {candidates[c] for c in names if c.startswith(u) and len(u) >= 4}
    if len(prefixed) == 1:
        return next(prefixed.__iter__()).replace("_", "-")
    return None


def _option_candidates(parser) -> dict[str, str]:
    return {o.lstrip("-"): a.dest for a in parser._actions for o in a.option_strings
            if o.startswith("--") and a.dest != "help"}


def _unknown(parser, token: str) -> ConfigError:
    name = token.split("=")[0]
    if name in MEGATRON_ANSWERS:
        return ConfigError(f"{name}: {MEGATRON_ANSWERS[name]}")
    if not name.startswith("-"):
        return ConfigError(f"unexpected value {token!r}: every flag takes one value except --data-path "
                           f"({HELP_HINT})")
    close = suggest(name, _option_candidates(parser))
    hint = f"; did you mean --{close}?" if close else ""
    return ConfigError(f"unknown argument {name!r}{hint} ({HELP_HINT})")


RULES_ENV = "GRIDTRON_BACKEND_RULES"  # default of --backend-rules (the test suite sets it to hccl)


def config_from_values(values: dict, explicit: typing.Iterable[str] = ()) -> RunConfig:
    """A RunConfig from flat {field: value} (values already of the field's type)."""
    table = field_table()
    if "backend_rules" not in values and os.environ.get(RULES_ENV):
        values = {**values, "backend_rules": os.environ[RULES_ENV]}
    sections: dict[str, dict] = {s: {} for s in SECTIONS}
    top = {}
    for name, value in values.items():
        info = table[name]
        if info.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        (sections[info.section] if info.section else top)[name] = value
    if "seed" in top:
        sections["model"]["seed"] = top["seed"]
    try:
        built = {s: cls(**sections[s]) for s, cls in SECTIONS.items()}
        return RunConfig(**built, **top, explicit=tuple(sorted(set(explicit))))
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def parse_args(argv: list[str] | None = None) -> RunConfig:
    from engine.recipe import load_recipe
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown(parser, unknown[0])
    flags = vars(args)
    path = flags.pop("config", None)
    values = load_recipe(path) if path else {}
    values.update(flags)
    cfg = config_from_values(values, values)
    if cfg.checkpoint.use_checkpoint_args and cfg.checkpoint.load:
        from engine.checkpoint.reader import with_checkpoint_args
        cfg = with_checkpoint_args(cfg)
    return cfg
