"""Command line and YAML recipes for ``python -m engine.train``.

Flags are generated from the config dataclasses (``--num-layers`` for ``num_layers``) with
Megatron-LM's long names as aliases. A YAML recipe (``--config``) uses the same keys in snake_case
or dashed form; flags given on the command line override it. Unknown flags and unknown YAML keys are
errors that name the closest valid key.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing

import yaml

from engine.config import (CheckpointConfig, CompressionConfig, DataConfig, LogConfig, OptimConfig,
                           ParallelConfig, PrecisionConfig, RunConfig)
from models.config import GPTConfig

SECTIONS = {"model": GPTConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "precision": PrecisionConfig, "data": DataConfig, "compression": CompressionConfig,
            "checkpoint": CheckpointConfig, "log": LogConfig}
TOP_LEVEL = {"device": str, "compile": bool, "seed": int}
ALIASES = {
    "tp": ["--tensor-model-parallel-size"], "pp": ["--pipeline-model-parallel-size"],
    "cp": ["--context-parallel-size"],
    "dp": ["--data-parallel-size"], "virtual_pipeline_size": ["--virtual-pipeline-model-parallel-size", "--vp"],
    "seq_length": ["--seq-len"], "num_attention_heads": ["--heads"], "hidden_size": ["--hidden"],
    "train_iters": ["--iters"], "micro_batch_size": ["--mbs"], "global_batch_size": ["--gbs"],
    "grad_compression_ratio": ["--topk-ratio"], "recompute": ["--recompute-granularity"],
}


class ConfigError(ValueError):
    """A bad flag, recipe key or value; the message says what to change."""


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _field_table() -> dict[str, tuple[str | None, type]]:
    table = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if section == "model" and f.name == "seed":
                continue  # the run's --seed feeds the model's initializer
            table[f.name] = (section, _base_type(hints[f.name]))
    for name, tp in TOP_LEVEL.items():
        table[name] = (None, tp)
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__,
                                     argument_default=argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config", help="YAML recipe; flags override its keys")
    for name, (_, tp) in _field_table().items():
        flags = [f"--{name.replace('_', '-')}"] + ALIASES.get(name, [])
        if tp is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction)
        elif tp is dict:
            parser.add_argument(*flags, dest=name, type=json.loads, help="JSON object")
        else:
            parser.add_argument(*flags, dest=name, type=tp)
    return parser


def _normalise(key: str) -> str:
    return key.replace("-", "_")


def load_recipe(path: str) -> dict:
    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"--config {path}: no such file") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: a recipe is a mapping of keys to values")
    table, values = _field_table(), {}
    for key, value in raw.items():
        name = _normalise(str(key))
        if name not in table:
            close = difflib.get_close_matches(name, list(table), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--config {path}: unknown key {key!r}{hint}")
        values[name] = value
    return values


RULES_ENV = "GRIDTRON_BACKEND_RULES"  # default of --backend-rules (the test suite sets it to hccl)


def config_from_values(values: dict) -> RunConfig:
    table = _field_table()
    if "backend_rules" not in values and os.environ.get(RULES_ENV):
        values = {**values, "backend_rules": os.environ[RULES_ENV]}
    sections: dict[str, dict] = {s: {} for s in SECTIONS}
    top = {}
    for name, value in values.items():
        section, tp = table[name]
        if tp in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = tp(value)
        (sections[section] if section else top)[name] = value
    if "seed" in top:
        sections["model"]["seed"] = top["seed"]
    try:
        built = {s: cls(**sections[s]) for s, cls in SECTIONS.items()}
        return RunConfig(**built, **top)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def parse_args(argv: list[str] | None = None) -> RunConfig:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [o for a in parser._actions for o in a.option_strings]
        close = difflib.get_close_matches(unknown[0].split("=")[0], known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown argument {unknown[0]!r}{hint} (python -m engine.train --help lists all)")
    flags = vars(args)
    values = load_recipe(flags.pop("config")) if flags.get("config") else {}
    flags.pop("config", None)
    values.update(flags)
    return config_from_values(values)
