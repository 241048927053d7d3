"""Reading a recipe's YAML file (``--config FILE``) for engine/config/recipe.py.

PyYAML resolves plain scalars by YAML 1.1, where ``010`` is octal 8, ``1:30`` is base 60 (90) and
``0b11`` binary. A recipe's integers are read as YAML 1.2's core schema reads them instead: decimal
(``010`` is 10; digits may be grouped with ``_`` as in ``10_000``), ``0o`` octal and ``0x``
hexadecimal; anything else (``1:30``, ``0b11``) is text, which an integer field then refuses in one
line. Floats keep YAML 1.1's forms (``3.0e-4``, ``.5``, ``.inf``) without base 60; ``3e-4``, which
YAML 1.1 reads as text, a float field converts itself.

The reader refuses a key given twice in one mapping (PyYAML keeps the last silently) and records,
for each mapping, the line of every key (``_Mapping.lines``) and the source text of every unquoted
scalar value or list of them (``_Mapping.texts``), so a string field keeps what was written
(``wandb_exp_name: 1.10`` is "1.10", not "1.1"). Malformed YAML, a missing file, a directory, an
unreadable file and bytes that are not UTF-8 (with their line) are each one ConfigError line.
"""
from __future__ import annotations

import re

import yaml

from engine.base import ConfigError

INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_INT = re.compile(r"^(?:[-+]?[0-9]+(?:_[0-9]+)*|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
                     |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                     |[-+]?\.(?:inf|Inf|INF)
                     |\.(?:nan|NaN|NAN))$""", re.X)


class _Mapping(dict):
    """A YAML mapping that remembers the line (1-based) of each key and the source text of each
    unquoted scalar value (a list of texts for a list of scalars)."""
    lines: dict
    texts: dict


def _text_of(node):
    """The source text of a plain scalar, a list of them for a sequence of scalars, else None."""
    if isinstance(node, yaml.ScalarNode):
        return node.value if node.style is None else None
    if isinstance(node, yaml.SequenceNode) and all(isinstance(n, yaml.ScalarNode) for n in node.value):
        return [n.value if n.style is None else None for n in node.value]
    return None


class _Loader(yaml.SafeLoader):
    """safe_load with YAML 1.2's integers, that refuses a key given twice in one mapping and
    records each key's line and each plain value's text."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)  # YAML merge keys (<<) first, as SafeLoader does
        lines, texts = {}, {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                continue  # an unhashable key: the base constructor reports it
            if key in lines:
                raise ConfigError(f"{self.name}:{line}: {key} is given twice (lines {lines[key]} and "
                                  f"{line}); keep one")
            lines[key] = line
            texts[key] = _text_of(value_node)
        out = _Mapping(super().construct_mapping(node, deep=deep))
        out.lines, out.texts = lines, texts
        return out

    def construct_yaml_int(self, node):
        """YAML 1.2 core: decimal (leading zeros allowed, ``_`` between digits), 0o, 0x."""
        text = self.construct_scalar(node).replace("_", "")
        if text[:2] in ("0o", "0x"):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)


def _resolvers() -> dict:
    """SafeLoader's implicit resolvers with its int and float forms replaced in place (the order
    of the others, timestamps after numbers, kept)."""
    out = {}
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items():
        kept = []
        for tag, regexp in resolvers:
            if tag == INT_TAG:
                regexp = _INT
            elif tag == FLOAT_TAG:
                regexp = _FLOAT
            kept.append((tag, regexp))
        out[first] = kept
    return out


_Loader.yaml_implicit_resolvers = _resolvers()
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)
_Loader.add_constructor(INT_TAG, _Loader.construct_yaml_int)


def read_yaml(path: str):
    """The recipe file's YAML document (mappings as ``_Mapping``), or a one-line ConfigError."""
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


def lines_of(mapping) -> dict:
    return getattr(mapping, "lines", {})


def texts_of(mapping) -> dict:
    return getattr(mapping, "texts", {})
