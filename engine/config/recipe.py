"""YAML recipes (``--config FILE``): the same keys as the flags, checked against the config's types.

Keys are snake_case or dashed, flat or grouped under the config's own sections (``model:``,
``parallel:``, ``optim:``, ``precision:``, ``data:``, ``compression:``, ``checkpoint:``, ``log:``).
The file is read by engine/config/recipe_yaml.py: integers as YAML 1.2 reads them (``010`` is 10,
``1:30`` is text, ``0x10`` is 16), and a string field keeps the text written (``1.10`` stays
"1.10"). PyYAML reads ``3e-4`` as a string (YAML 1.1 wants ``3.0e-4``): a float field accepts it.
``moe_layer_freq`` takes a YAML list of 0/1 as well as the command line's string. Everything else
must already have the field's type: ``num_layers: 2.7`` or ``mock_data: "false"`` is an error
naming the key, the value and the type expected (``train_iters: 1e3``: "write 1000"). Malformed
YAML is one line with file, line and column; a key given twice (in one mapping, or as ``lr`` and
``optim: lr``) names both lines; a directory, an unreadable file or bytes that are not UTF-8 (with
their line) are one line too. An unknown key is answered in one line: the recipe's spelling of a
command-line switch (``bf16: true``), alias or Megatron ``no_X`` switch (``no_load_optim: true``),
Megatron's answer, or a close key.
"""
from __future__ import annotations

import math
import re

from engine.base import ConfigError, FieldInfo
from engine.config.fields import SECTIONS, field_table, flag_info, suggest
from engine.config.flags import CONSTANTS, GROUPS
from engine.config.megatron_answers import CHOICE_ANSWERS, MEGATRON_ANSWERS
from engine.config.recipe_yaml import lines_of, read_yaml, texts_of

TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
              dict: "a mapping", list: "a list (or one string)"}
LIST_AS_TEXT = {"moe_layer_freq"}  # string fields that also take a YAML list of integers


def _expected(info: FieldInfo) -> str:
    return TYPE_NAMES[info.type] + (" or null" if info.optional else "")


def _integral(value) -> int | None:
    """The integer a float-looking ``value`` (``1e3``, ``2.0``) stands for, else None."""
    if isinstance(value, bool) or not isinstance(value, (str, float)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _as_text(value, text, key: str):
    """A string field's value: the text written for a plain scalar (``1.10``, a date), a YAML list
    of integers as the command line writes it for LIST_AS_TEXT fields, else None (refused)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, dict)):
        return None
    if isinstance(value, list):
        if key not in LIST_AS_TEXT or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            return None
        return "[" + ",".join(str(v) for v in value) + "]"
    if isinstance(text, str):
        return text
    return str(value) if isinstance(value, (int, float)) else None


def _as_list(value, text):
    """A list field's items as text (the text written for plain scalars), or None (refused)."""
    if isinstance(value, str):
        return value.split()
    if not isinstance(value, list) or any(isinstance(v, (bool, list, dict)) or v is None for v in value):
        return None
    texts = text if isinstance(text, list) and len(text) == len(value) else [None] * len(value)
    return [v if isinstance(v, str) else (t if t is not None else str(v)) for v, t in zip(value, texts)]


def coerce(key: str, value, info: FieldInfo, where: str, text=None):
    """``value`` as the field's type, or a ConfigError that says what was expected. ``text``: the
    value's source text (recipe_yaml.py), kept by string and list fields."""
    def bad():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        shown = text if isinstance(text, str) and numeric else repr(value)
        whole = _integral(value) if tp is int else None
        write = f"; write {whole}" if whole is not None else ""
        return ConfigError(f"{where}: {key}: {shown} is not {_expected(info)} "
                           f"({info.type.__name__} expected){write}")
    tp = info.type
    if value is None:
        if info.optional:
            return None
        raise bad()
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
    elif tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad() from None
        elif not isinstance(value, (int, float)):
            raise bad()
        value = float(value)
    elif tp in (str, list):
        converted = _as_text(value, text, key) if tp is str else _as_list(value, text)
        if converted is None:
            raise bad()
        value = converted
    elif tp is dict:
        if not isinstance(value, dict):
            raise bad()
    choices = flag_info(key).choices
    if choices and value is not None and value not in choices:
        answer = CHOICE_ANSWERS.get(key, {}).get(value)
        raise ConfigError(f"{where}: {key}: {value!r} is not one of {', '.join(choices)}"
                          + (f"; {answer}" if answer else ""))
    return value


def _alias_field(option: str, table: dict) -> str | None:
    """The field whose command-line alias ``option`` is (``--tensor-model-parallel-size``: tp)."""
    return next((name for name in table if option in flag_info(name).aliases), None)


def _fits(value, info: FieldInfo) -> bool:
    """Whether ``value`` has the field's type (its choices aside: a misspelt key with a wrong
    value is still that key)."""
    try:
        coerce("", value, info, "")  # "" has no flag entry, so no choices
    except ConfigError:
        return False
    return True


def _switch_answer(key: str, value, table: dict) -> str | None:
    """What to write for a command-line switch used as a key, by its value: ``bf16: true`` is
    ``precision: bf16``, ``bf16: false`` the default; Megatron's ``no_load_optim: true`` is
    ``load_optim: false``. None for a key that is no switch."""
    option = "--" + key.replace("_", "-")
    if option in CONSTANTS:
        field, const = CONSTANTS[option][:2]
        if value:
            return f"write {field}: {const} ({option} is the command line's switch for it)"
        default = table[field].default
        return f"leave it out ({field} defaults to {default}) or write {field}: {default}"
    base = key.replace("-", "_")[3:] if key.replace("-", "_").startswith("no_") else None
    if base not in table or table[base].type is not bool:
        return None
    if value is True:
        return f"write {base}: false ({option} is the command line's switch for it)"
    if value is False:
        return f"write {base}: true" + (f", or leave it out ({base} defaults to true)"
                                        if table[base].default is True else "")
    return f"the recipe's key is {base}, true or false ({option} is the command line's switch " \
           f"for {base}: false)"


def _unknown(key: str, value, table: dict, where: str) -> ConfigError:
    """The unknown key's line: the recipe's spelling of a command-line switch (``bf16: true``,
    ``no_load_optim: true``) or alias (``tensor_model_parallel_size: 2``), the section of a --help
    group's name (``mixed_precision:``), Megatron's answer, or a close key that can take ``value``."""
    option = "--" + key.replace("_", "-")
    if key.replace("-", "_") == "config":
        return ConfigError(f"{where}: unknown key {key!r}: a recipe does not include another recipe: "
                           f"merge its keys into this file")
    switch = _switch_answer(key, value, table)
    if switch:
        return ConfigError(f"{where}: unknown key {key!r}: {switch}")
    alias_of = _alias_field(option, table)
    if alias_of:
        return ConfigError(f"{where}: unknown key {key!r}: the recipe's key is {alias_of} ({option} "
                           f"is the command line's alias for it)")
    group = key.replace("_", " ").replace("-", " ").strip().lower()
    if group in GROUPS:
        homes = {table[n].section for n in table if flag_info(n).group == group}
        if len(homes) == 1 and None not in homes:
            return ConfigError(f"{where}: unknown key {key!r}: that is a group of --help; the "
                               f"recipe's section is {homes.pop()}: (or write its keys flat)")
        sections = ", ".join(f"{h}:" for h in sorted(h for h in homes if h))
        return ConfigError(f"{where}: unknown key {key!r}: that is a group of --help, not a "
                           f"section; write its keys flat or under their sections ({sections})")
    if option in MEGATRON_ANSWERS:
        return ConfigError(f"{where}: unknown key {key!r}: {MEGATRON_ANSWERS[option]} (recipe keys "
                           f"are the flags' names)")
    close = suggest(key, {k.replace("_", "-"): k for k in table})
    close = close and close.replace("-", "_")
    hint = f"; did you mean {close!r}?" if close and _fits(value, table[close]) else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def load_recipe(path: str, origins: dict | None = None) -> dict:
    """The recipe's {field: value}, flattened and type-checked; ``origins``, when given, gets
    {field: (line, key as spelled)} for each (``located``)."""
    raw = read_yaml(path) or {}
    where = f"--config {path}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a recipe is a mapping of keys to values")
    table, values, seen = field_table(), {}, {}

    def put(key, value, section=None, line=None, text=None):
        name = str(key).replace("-", "_")
        if name not in table:
            raise _unknown(str(key), value, table, where)
        info = table[name]
        if section is not None and info.section != section:
            home = f"{info.section}:" if info.section else "the top level"
            raise ConfigError(f"{where}: {key!r} is not a {section} key; it belongs under {home}")
        if name in values:
            first, spelled = seen[name]
            raise ConfigError(f"{where}:{line}: {name} is given twice ({spelled} on line {first}, "
                              f"{section + '.' if section else ''}{key} on line {line}); keep one")
        seen[name] = (line, f"{section + '.' if section else ''}{key}")
        if origins is not None:
            origins[name] = seen[name]
        values[name] = coerce(name, value, info, where, text)

    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for inner, v in value.items():
                put(inner, v, name, lines_of(value).get(inner), texts_of(value).get(inner))
        elif name in SECTIONS and name not in table:
            raise ConfigError(f"{where}: {key}: expected a mapping of {name} keys, got {value!r}")
        else:
            put(key, value, line=lines_of(raw).get(key), text=texts_of(raw).get(key))
    return values


def located(message: str, path: str, origins: dict, given=()) -> str:
    """``message`` (a configuration error naming flags) with where the recipe at ``path`` set
    each flag it names that the command line did not (``given``: field names), e.g.
    ``--num-layers must be >= 1, got 0 (set in --config run.yaml: num_layers on line 4)``."""
    named = dict.fromkeys(f.replace("-", "_") for f in re.findall(r"--([a-z][a-z0-9-]*)", message))
    places = [f"{origins[n][1]} on line {origins[n][0]}" if origins[n][0] else origins[n][1]
              for n in named if n in origins and n not in given]
    return f"{message} (set in --config {path}: {', '.join(places)})" if places else message
