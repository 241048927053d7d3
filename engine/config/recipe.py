"""YAML recipes (``--config FILE``): the same keys as the flags, checked against the config's types.

Keys are snake_case or dashed, flat or grouped under the config's own sections (``model:``,
``parallel:``, ``optim:``, ``precision:``, ``data:``, ``compression:``, ``checkpoint:``, ``log:``).
PyYAML reads ``3e-4`` as a string (YAML 1.1 wants ``3.0e-4``): a float field accepts it. Everything
else must already have the field's type: ``num_layers: 2.7`` or ``mock_data: "false"`` is an error
naming the key, the value and the type expected. Malformed YAML is one line with file, line and
column; a key given twice (in one mapping, or as ``lr`` and ``optim: lr``) names both lines; a
directory, an unreadable file or bytes that are not UTF-8 (with their line) are one line too.
"""
from __future__ import annotations

import yaml

from engine.base import ConfigError, FieldInfo
from engine.config.fields import SECTIONS, field_table, flag_info, suggest
from engine.config.flags import CONSTANTS, GROUPS
from engine.config.megatron_answers import CHOICE_ANSWERS, MEGATRON_ANSWERS

TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
              dict: "a mapping", list: "a list (or one string)"}


def _expected(info: FieldInfo) -> str:
    return TYPE_NAMES[info.type] + (" or null" if info.optional else "")


def coerce(key: str, value, info: FieldInfo, where: str):
    """``value`` as the field's type, or a ConfigError that says what was expected."""
    def bad():
        return ConfigError(f"{where}: {key}: {value!r} is not {_expected(info)} "
                           f"({info.type.__name__} expected)")
    if value is None:
        if info.optional:
            return None
        raise bad()
    tp = info.type
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
    elif tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise bad()
        value = str(value)
    elif tp is list:
        if isinstance(value, str):
            value = value.split()
        elif not isinstance(value, list) or any(isinstance(v, (bool, list, dict)) or v is None
                                                for v in value):
            raise bad()
        value = [str(v) for v in value]
    elif tp is dict:
        if not isinstance(value, dict):
            raise bad()
    choices = flag_info(key).choices
    if choices and value is not None and value not in choices:
        answer = CHOICE_ANSWERS.get(key, {}).get(value)
        raise ConfigError(f"{where}: {key}: {value!r} is not one of {', '.join(choices)}"
                          + (f"; {answer}" if answer else ""))
    return value


class _Mapping(dict):
    """A YAML mapping that remembers the line (1-based) of each key."""
    lines: dict


class _Loader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently)
    and records each key's line."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)  # YAML merge keys (<<) first, as SafeLoader does
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                continue  # an unhashable key: the base constructor reports it
            if key in lines:
                raise ConfigError(f"{self.name}:{line}: {key} is given twice (lines {lines[key]} and "
                                  f"{line}); keep one")
            lines[key] = line
        out = _Mapping(super().construct_mapping(node, deep=deep))
        out.lines = lines
        return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            loader = _Loader(fh)
            loader.name = f"--config {path}"
            try:
                return loader.get_single_data()
            finally:
                loader.dispose()
    except FileNotFoundError as exc:
        raise ConfigError(f"--config {path}: no such file") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"--config {path} is a directory; give the recipe's YAML file") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}:{_not_utf8(path)}; save the recipe as UTF-8") from exc
    except OSError as exc:  # unreadable: permissions, a device, ...
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc}); give a "
                          f"readable YAML file") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        raise ConfigError(f"--config {where}: malformed YAML: {problem}") from exc


def _not_utf8(path: str) -> str:
    """'LINE: not UTF-8 text (byte 0xNN at offset K)' for the file's first byte that is not UTF-8
    (the whole file decoded at once: a text stream's offsets count from its last chunk)."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        return f"{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
    return " not UTF-8 text"


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


def _unknown(key: str, value, table: dict, where: str) -> ConfigError:
    """The unknown key's line: the recipe's spelling of a command-line switch (``bf16: true``) or
    alias (``tensor_model_parallel_size: 2``), the section of a --help group's name
    (``mixed_precision:``), Megatron's answer, or a close key that can take ``value``."""
    option = "--" + key.replace("_", "-")
    if option in CONSTANTS:
        field, const = CONSTANTS[option][:2]
        return ConfigError(f"{where}: unknown key {key!r}: write {field}: {const} ({option} is the "
                           f"command line's switch for it)")
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


def load_recipe(path: str) -> dict:
    """The recipe's {field: value}, flattened and type-checked."""
    raw = _read(path) or {}
    where = f"--config {path}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a recipe is a mapping of keys to values")
    table, values, seen = field_table(), {}, {}

    def put(key, value, section=None, line=None):
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
        values[name] = coerce(name, value, info, where)

    def line_of(mapping, key):
        return getattr(mapping, "lines", {}).get(key)

    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in SECTIONS and isinstance(value, dict):
            for inner, v in value.items():
                put(inner, v, name, line_of(value, inner))
        elif name in SECTIONS and name not in table:
            raise ConfigError(f"{where}: {key}: expected a mapping of {name} keys, got {value!r}")
        else:
            put(key, value, line=line_of(raw, key))
    return values
