"""``python -m engine.dryrun``: a training job's layout dry-run on this machine.

    python -m engine.dryrun --config recipe.yaml --world-size 1024 [--tp 8 --pp 8 ...] \\
        [--device h100 | --memory-gb 80] [--devices-per-node 8] [--json dryrun.json]

Every ``engine.train`` flag and recipe key is accepted and means what it means there. The dry
run's own flags: ``--world-size`` (the job's ranks), ``--device`` (a planner device name, e.g.
a100-80gb, h100, ascend910b2: its memory for the fit check and its backend, HCCL or NCCL, whose
rules every collective is checked against and whose communicators are priced; engine.train's
npu/cuda/cpu/auto choose the backend only), ``--memory-gb`` (overrides the device's memory),
``--devices-per-node`` (default the device's, else 8: TP groups must stay inside a node) and
``--json FILE``. Exit status: 0, every rank fits (or no memory was given); 1, some rank needs more
than the usable memory; 2, the run would reject the configuration (the message says why).
"""
from __future__ import annotations

import argparse
import sys

from engine.base import ConfigError
from engine.training.launch import run_config
from engine.config.schema import DEVICES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.dryrun", description=__doc__.split("\n\n")[0],
                                epilog="Every other flag is engine.train's (python -m engine.train "
                                       "--help).", allow_abbrev=False)
    p.add_argument("--world-size", type=int, required=True, help="ranks of the job")
    p.add_argument("--device", help="planner device name (python -m engine.plan --help lists them) "
                                    "or engine.train's npu/cuda/cpu/auto")
    p.add_argument("--memory-gb", type=float, help="device memory in GiB (overrides --device's)")
    p.add_argument("--devices-per-node", type=int, help="ranks per node (default: the device's, else 8)")
    p.add_argument("--json", metavar="FILE", help="write the roles, collectives and comparison here")
    return p


def main(argv: list[str] | None = None) -> int:
    from engine.dryrun import dry_run
    from engine.dryrun.report import text, write_json
    args, rest = build_parser().parse_known_args(argv)
    device = args.device
    if device in DEVICES:                   # engine.train's meaning: the backend, no memory
        rest += ["--device", device]
        device = None
    try:
        cfg = run_config(rest)
        result = dry_run(cfg, args.world_size, device, args.memory_gb, args.devices_per_node)
    except KeyError as exc:                 # an unknown --device name
        print(f"gridtron dry run: {exc.args[0]}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as exc:
        print(f"gridtron dry run: configuration error: {exc}", file=sys.stderr)
        return 2
    print(text(result))
    if args.json:
        write_json(result, args.json)
    return 0 if all(result.fits(r) for r in result.records) else 1
