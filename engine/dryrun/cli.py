"""``python -m engine.dryrun``: a training job's layout dry-run on this machine.

    python -m engine.dryrun --config recipe.yaml --world-size 1024 [--tp 8 --pp 8 ...] \\
        [--device h100 | --memory-gb 80] [--devices-per-node 8] [--json dryrun.json]

Every ``engine.train`` flag and recipe key is accepted and means what it means there. The dry
run's own flags: ``--world-size`` (the job's ranks), ``--device`` (a planner device name, e.g.
a100-80gb, h100, ascend910b2: its memory for the fit check and its backend, HCCL or NCCL, whose
rules every collective is checked against and whose communicators are priced; under
``--fp8-format`` a device without FP8 is refused with the planner's check; engine.train's
npu/cuda/cpu/auto choose the backend only), ``--memory-gb`` (overrides the device's memory),
``--devices-per-node`` (default the device's, else 8: TP groups must stay inside a node) and
``--json FILE``. Exit status: 0, every rank fits (or no memory was given); 1, some rank needs more
than the usable memory; 2, the run would reject the configuration: one line, ``gridtron:
configuration error: ...``, as engine.train says it.
"""
from __future__ import annotations

import argparse
import math
import os

from engine.base import ConfigError, ToolParser, run_tool
from engine.config.cli import with_recipe_lines
from engine.config.fields import suggest
from engine.config.schema import DEVICES
from engine.plan.model import MAX_DEVICES
from engine.training.launch import run_config
from engine.training.validate import unwritable

HELP_HINT = "python -m engine.dryrun --help lists its flags, python -m engine.train --help the others"
OWN_FLAGS = ("world-size", "device", "memory-gb", "devices-per-node", "json")


class _Parser(ToolParser):
    def error(self, message):  # one line, naming where both tools' flags are listed
        raise ConfigError(f"{message} ({HELP_HINT})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.dryrun", description=__doc__.split("\n\n")[0],
                epilog="Every other flag is engine.train's (python -m engine.train --help).")
    p.add_argument("--world-size", type=int, help="ranks of the job (required)")
    p.add_argument("--device", help="planner device name (python -m engine.plan --help lists them) "
                                    "or engine.train's npu/cuda/cpu/auto")
    p.add_argument("--memory-gb", type=float, help="device memory in GiB (overrides --device's)")
    p.add_argument("--devices-per-node", type=int, help="ranks per node (default: the device's, else 8)")
    p.add_argument("--json", metavar="FILE", help="write the roles, collectives and comparison here")
    return p


def check_args(args: argparse.Namespace, rest: list[str]) -> None:
    """The dry run's own flags, before any work (ConfigError, one line): a misspelt one of them
    among engine.train's, the world size, the node size, the memory and the --json path."""
    for token in rest:
        name = token.split("=")[0]
        if name.startswith("--") and name[2:] not in OWN_FLAGS:
            meant = suggest(name, {f: f for f in OWN_FLAGS})
            if meant:
                raise ConfigError(f"unknown argument {name!r}; did you mean --{meant}? ({HELP_HINT})")
    if args.world_size is None:
        raise ConfigError("--world-size N is required: the ranks of the job")
    if not 1 <= args.world_size <= MAX_DEVICES:
        raise ConfigError(f"--world-size must be between 1 and {MAX_DEVICES:,}, got {args.world_size}")
    if args.devices_per_node is not None and not 1 <= args.devices_per_node <= MAX_DEVICES:
        raise ConfigError(f"--devices-per-node must be between 1 and {MAX_DEVICES:,}, got "
                          f"{args.devices_per_node}")
    if args.memory_gb is not None and not (math.isfinite(args.memory_gb) and args.memory_gb > 0):
        raise ConfigError(f"--memory-gb must be a positive number of GiB, got {args.memory_gb}")
    if args.json is not None:
        problem = json_path_problem(args.json)
        if problem:
            raise ConfigError(f"--json {args.json}: {problem}; choose a file path you can write to")


def json_path_problem(path: str) -> str | None:
    """Why ``path`` cannot take the --json document (None when it can); creates nothing."""
    if not path or path.endswith(os.sep):
        return "names a directory, not a file"
    if os.path.isdir(path):
        return "is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{parent} does not exist" if not os.path.exists(parent) else f"{parent} is a file"
    return unwritable(parent)


def main(argv: list[str] | None = None) -> int:
    """A mistake is one line, ``gridtron: configuration error: ...`` (an unknown --device: ``gridtron:
    unknown device ...``), exit 2 (engine/base.py ``run_tool``)."""
    from engine.dryrun import dry_run
    from engine.dryrun.report import text, write_json

    def body() -> int:
        rest: list[str] = []
        try:
            args, rest = build_parser().parse_known_args(argv)
            check_args(args, rest)
            device = args.device
            if device in DEVICES:               # engine.train's meaning: the backend, no memory
                rest += ["--device", device]
                device = None
            cfg = run_config(rest)
            result = dry_run(cfg, args.world_size, device, args.memory_gb, args.devices_per_node)
        except (ConfigError, ValueError) as exc:
            raise ConfigError(f"configuration error: {with_recipe_lines(str(exc), rest)}") from exc
        print(text(result))
        if args.json:
            write_json(result, args.json)
        return 0 if all(result.fits(r) for r in result.records) else 1

    return run_tool(body, (KeyError, lambda e: e.args[0], 2))  # an unknown --device name
