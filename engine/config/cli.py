"""Command line and YAML recipes for ``python -m engine.train``.

Flags are generated from the config dataclasses (``--num-layers`` for ``num_layers``); help, group,
choices and Megatron-LM's spellings come from the table in engine/config/flags.py, defaults from the
dataclasses. A YAML recipe (``--config``, engine/config/recipe.py) uses the same keys, flat or grouped in
the config's own sections; flags given on the command line override it. Unknown flags and keys are
errors that name the intended flag when the intent is clear, and Megatron flags that have no
equivalent here are answered with what to do instead; every unknown flag of a command line is named
in the one line. A mapping flag (``--grad-compression-policy``) takes a JSON object or null.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import typing

from engine.base import ConfigError
from engine.config.fields import SECTIONS, field_table, flag_info, suggest
from engine.config.flags import CONSTANTS, GROUPS
from engine.config.megatron_answers import CHOICE_ANSWERS, MEGATRON_ANSWERS
from engine.config.recipe import load_recipe, located
from engine.config.schema import RunConfig

HELP_HINT = "python -m engine.train --help lists every flag"


def option_name(name: str) -> str:
    return f"--{name.replace('_', '-')}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + exit
        raise ConfigError(f"{message}{_choice_answer(self, message)} ({HELP_HINT})")


def _choice_answer(parser, message: str) -> str:
    """'; why' for a Megatron value of a real flag that is not built here (``--fp8-recipe
    delayed``), from CHOICE_ANSWERS; '' otherwise."""
    match = re.match(r"argument ([^:]+): invalid choice: '([^']*)'", message)
    if not match:
        return ""
    options = match.group(1).split("/")
    dest = next((a.dest for a in parser._actions if options[0] in a.option_strings), None)
    answer = CHOICE_ANSWERS.get(dest, {}).get(match.group(2))
    return f"; {answer}" if answer else ""


GIVEN = "_given"  # namespace attribute: (option, field, value) of every setting of a switch's field


class _Recorded(argparse.Action):
    """Stores like ``store`` / ``store_const`` and records who set the field, so that two options
    setting one field to different values (``--fp16 --bf16``, ``--precision fp32 --bf16``) are
    refused instead of the last silently winning."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        getattr(namespace, GIVEN, None) or setattr(namespace, GIVEN, [])
        getattr(namespace, GIVEN).append((option_string, self.dest, value))
        setattr(namespace, self.dest, value)


def _shown(option: str, value) -> str:
    return option if option in CONSTANTS else f"{option} {value}"


def _conflicts(given: list[tuple[str, str, object]]) -> None:
    """A ConfigError when a switch (``--bf16``) and another setting of its field disagree; a
    plain flag given twice keeps argparse's rule (the last wins)."""
    kept: dict[str, tuple[str, object]] = {}  # field -> the setting that stands so far
    for option, dest, value in given:
        if dest in kept:
            was, old = kept[dest]
            if old != value and (option in CONSTANTS or was in CONSTANTS):
                raise ConfigError(f"{_shown(was, old)} and {_shown(option, value)} contradict each "
                                  f"other (both set --{dest.replace('_', '-')}); give one")
            if was in CONSTANTS and option not in CONSTANTS:
                continue  # --bf16 --precision bf16: the switch stays the one named
        kept[dest] = (option, value)


_JSON_KINDS = ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"),
               (list, "an array"))
_JSON_EXAMPLE = """give an object such as '{"default": "int8"}', or null for none"""


def json_object(text: str) -> dict | None:
    """A mapping flag's value (``--grad-compression-policy JSON``): a JSON object, or null (none,
    as in a recipe: it clears the recipe's), else one line saying what was wrong (argparse prints
    it after the flag's name)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({exc.msg} at {at}); "
                                         f"{_JSON_EXAMPLE}") from None
    if value is not None and not isinstance(value, dict):
        kind = next(name for tp, name in _JSON_KINDS if isinstance(value, tp))
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} is {kind}; {_JSON_EXAMPLE}")
    return value


class _OrNone(tuple):
    """An optional field's choices as the flag offers them (``'none'`` last), holding the None
    that ``_or_none`` makes of it."""

    def __contains__(self, value) -> bool:
        return value is None or tuple.__contains__(self, value)


def _or_none(kind):
    """An optional field's flag type: ``none`` is None (unset: it clears what a recipe set, e.g.
    ``--fp8-format none`` over a recipe's ``fp8_format: e4m3``), anything else ``kind``'s value."""
    def parse(text: str):
        return None if text.strip().lower() == "none" else kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine.train", description=__doc__,
                     usage="%(prog)s [--config FILE] [--FLAG VALUE ...]",
                     argument_default=argparse.SUPPRESS, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe; flags override its keys")
    groups = {g: parser.add_argument_group(g) for g in GROUPS}
    table = field_table()
    switched = {name for name, *_ in CONSTANTS.values()}  # fields a Megatron switch also sets
    for name, info in table.items():
        flag = flag_info(name)
        group = groups.get(flag.group, groups["training"])
        flags = [option_name(name)] + list(flag.aliases)
        shown = flag.default_text or ("none" if info.default is None else info.default)
        text = f"{flag.help} (default: {shown})"
        if info.type is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=text)
        elif info.type is dict:
            group.add_argument(*flags, dest=name, type=json_object, metavar="JSON", help=text)
        elif info.type is list:
            group.add_argument(*flags, dest=name, nargs="+", metavar="ITEM", help=text)
        else:
            metavar = None if flag.choices else {int: "N", float: "X"}.get(info.type, name.upper())
            kind, choices = info.type, flag.choices
            if info.optional and (info.type is not str or choices) and "none" not in (choices or ()):
                # "none" clears a recipe's setting (a free text field, a path, takes "none" as is)
                kind = _or_none(info.type)
                choices = choices and _OrNone((*choices, "none"))
            action = _Recorded if name in switched else "store"
            group.add_argument(*flags, dest=name, type=kind, choices=choices,
                               metavar=metavar, help=text, action=action)
    for option, (name, value, text, group) in CONSTANTS.items():
        if name in table:
            groups[group].add_argument(option, dest=name, action=_Recorded, nargs=0, const=value,
                                       help=text)
    return parser


def _takes(action, value: str | None) -> bool:
    """Whether ``action`` can take ``value`` (None: no value was given): a number flag cannot take
    ``1e-7`` as an int, so --lr-warmup-iters is not what ``--lr-warmup-init 1e-7`` meant."""
    if value is None or action.nargs == 0 or action.type is None:
        return True
    try:
        action.type(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


def _option_candidates(parser) -> dict[str, str]:
    return {o.lstrip("-"): a.dest for a in parser._actions for o in a.option_strings
            if o.startswith("--") and a.dest != "help"}


def _is_flag(token: str) -> bool:
    return re.match(r"-+[a-zA-Z]", token) is not None  # a negative number is a value


def _grouped(unknown: list[str]) -> list[tuple[str, list[str]]]:
    """argparse's leftover tokens as (flag, the values after it); values before any flag come as
    ('', values). A flag given again is reported once (its values with the first)."""
    items: dict[str, tuple[str, list[str]]] = {}
    current = None
    for token in unknown:
        if _is_flag(token):
            current = items.setdefault(token.split("=")[0], (token, []))
        else:
            if current is None:
                current = items.setdefault("", ("", []))
            current[1].append(token)
    return list(items.values())


def _answer(parser, token: str, values: list[str], alone: bool) -> tuple[str, bool]:
    """One leftover's line, and whether it is argparse's kind (no Megatron answer): ``--flag:
    answer``, ``unknown argument '--flag'; did you mean --other?`` (``alone``; among several:
    ``--flag: no such flag; ...``) or ``unexpected value 'x': ...``."""
    name = token.split("=")[0]
    if name in MEGATRON_ANSWERS:
        return f"{name}: {MEGATRON_ANSWERS[name]}", False
    if not token:
        return (f"unexpected value {values[0]!r}: every flag takes one value except --data-path",
                True)
    value = token.split("=", 1)[1] if "=" in token else next(iter(values), None)
    close = suggest(name, _option_candidates(parser))
    meant = close and next(a for a in parser._actions if f"--{close}" in a.option_strings)
    hint = f"; did you mean --{close}?" if meant and _takes(meant, value) else ""
    return (f"unknown argument {name!r}{hint}" if alone else f"{name}: no such flag{hint}"), True


def _unknown(parser, unknown: list[str]) -> ConfigError:
    """One line for every flag the parser did not take: its Megatron answer, a close flag, or
    argparse's refusal; several are numbered in the order given (``3 unknown arguments: (1) --a:
    ...; (2) --b: ...; (3) ...``), so a ported script's flags are all named in one run."""
    items = _grouped(unknown)
    lines = [_answer(parser, flag, values, len(items) == 1) for flag, values in items]
    hint = f" ({HELP_HINT})" if any(generic for _, generic in lines) else ""
    if len(lines) == 1:
        return ConfigError(lines[0][0] + hint)
    numbered = "; ".join(f"({i}) {text}" for i, (text, _) in enumerate(lines, 1))
    return ConfigError(f"{len(lines)} unknown arguments: {numbered}{hint}")


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
    par = sections["parallel"]  # model chunks per stage imply the interleaved schedule (Megatron-LM)
    if par.get("virtual_pipeline_size", 1) > 1 and par.get("pp", 1) > 1:
        par.setdefault("pipeline_schedule", "interleaved")
    try:
        built = {s: cls(**sections[s]) for s, cls in SECTIONS.items()}
        return RunConfig(**built, **top, explicit=tuple(sorted(set(explicit))))
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def with_recipe_lines(message: str, argv: list[str] | None = None) -> str:
    """A configuration error about the run of ``argv`` with the file and line of each flag it
    names that came from the ``--config`` recipe (recipe.py ``located``); as it was when there is
    no recipe or the command line itself does not parse."""
    try:
        args, _ = build_parser().parse_known_args(argv)
        flags = vars(args)
        path = flags.pop("config", None)
        if not path:
            return message
        origins: dict = {}
        load_recipe(path, origins)
    except (ConfigError, SystemExit, OSError):
        return message
    return located(message, path, origins, given=set(flags) - {GIVEN})


def parse_args(argv: list[str] | None = None) -> RunConfig:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown(parser, unknown)
    flags = vars(args)
    _conflicts(flags.pop(GIVEN, []))
    path = flags.pop("config", None)
    values = load_recipe(path) if path else {}
    values.update(flags)
    return config_from_values(values, values)
