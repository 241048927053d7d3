"""engine.train's own checks on the flags ``python -m engine.plan`` shares with it.

The planner takes some of engine.train's flags (``--precision`` / ``--bf16`` / ``--fp16``,
``--fp8-format``, ``--fp8-recipe``, ``--tp-comm-overlap``, ``--sequence-parallel``,
``--optimizer-offload-fraction``, ``--overlap-grad-reduce``, ``--overlap-param-gather``,
``--micro-batch-size``, and every model flag) and passes them on in the command it prints. They
go through engine.train's code, not a copy of it:

- ``check_shared``, before the search: the values as engine.train would hold them are built into
  its configuration (``engine.config.cli.config_from_values``: ``RunConfig`` and its sections,
  each checked in ``__post_init__``), so a combination engine.train refuses (``--precision fp16
  --fp8-format e4m3``, ``--tp-comm-overlap --sequence-parallel off``) is refused with its line;
- ``command_notes``, after it: the printed command goes through engine.train's parser
  (``parse_args``: a command it would refuse is its line, never printed), and with the user's
  shared flags laid over it through engine.train's notes on flags that change nothing
  (engine/config/unused_flags.py), in the best layout: ``--fp8-recipe rowwise`` without
  ``--fp8-format``, ``--tp-comm-overlap`` where the best layout has tp 1, ... each get
  engine.train's note, printed as engine.train prints it (``gridtron: note: ...``).

Only a flag that gives one value of engine.train's field is checked: ``--sequence-parallel on``
is, ``--sequence-parallel both`` (a search over both) and the searched lists (``--recompute
none,full``, ``--zero-stage``, ...) are not. Under ``--tp-comm-overlap`` the search plans sequence
parallelism on wherever tp > 1 (engine/plan/search.py), since engine.train refuses the overlap
without it. Imported by the command line only (engine/tools/plan_cli.py): the search and its
models stay free of engine.train's configuration.
"""
from __future__ import annotations

import argparse
import shlex
from dataclasses import replace

from engine.config.cli import config_from_values, parse_args
from engine.config.unused_flags import shown, unused_flag_notes
from models.registry import default_registry

DEVICE_TYPES = {"hccl": "npu", "gloo": "cpu", "nccl": "cuda"}  # the planned backend's device
ON_OFF = {"on": True, "off": False}   # "both": a search over both, no one value
# the planner's argument (its dest) -> (engine.train's field, how the planner's value reads there;
# None: as it is)
SHARED = {
    "precision": ("precision", None),
    "fp8_format": ("fp8_format", None),
    "fp8_recipe": ("fp8_recipe", None),
    "tp_comm_overlap": ("tp_comm_overlap", None),
    "sequence_parallel": ("sequence_parallel", ON_OFF),
    "offload_fraction": ("optimizer_offload_fraction", None),
    "overlap_grad_reduce": ("overlap_grad_reduce", ON_OFF),
    "overlap_param_gather": ("overlap_param_gather", ON_OFF),
    "micro_batch_size": ("micro_batch_size", None),
}


# a recipe's (--config's) keys that the planner's flags set, SHARED read the other way: key ->
# (the planner's argument, how the recipe's value reads there; None: as it is), and the offload
# switch, which the planner spells --offload. Each is taken where the flag is not typed.
RECIPE_SHARED = {field: (dest, None if meaning is None else {v: k for k, v in meaning.items()})
                 for dest, (field, meaning) in SHARED.items()}
RECIPE_SHARED["optimizer_cpu_offload"] = ("offload", {v: k for k, v in ON_OFF.items()})
# recipe keys that change what the run keeps or sends in a way the planner does not model: away
# from engine.train's default they are refused, so that no plan describes another run
UNMODELLED = {
    "grad_compression": "gradient compression's state and messages",
    "cp_comm_type": "Ulysses context parallelism (the planner prices the p2p ring)",
    "stage_end_weight": "uneven pipeline stages (the search splits the layers evenly; the memory "
                        "check at start and the dry run plan the run's split)",
    "bucket_size_mb": "the gradient bucket size (the planner prices the default buckets)",
    "first_last_layers_bf16": "FP8 runs' first and last layers in bf16",
    "scatter_gather_tensors_in_pipeline": "whole pipeline messages (the planner prices "
                                          "Megatron's scatter/gather)",
}
# the planner's search-space arguments: a one-value choice of the search, not a flag of the run,
# so engine.train's notes on the printed command do not name them
SEARCHED = ("sequence_parallel", "micro_batch_size")


def apply_recipe(args: argparse.Namespace, typed: frozenset[str], recipe: dict) -> frozenset[str]:
    """Lay a recipe's run keys over ``args`` where no flag was typed (RECIPE_SHARED), refusing
    those the planner cannot honour (UNMODELLED, away from engine.train's default; an fp32
    precision), and return the arguments now given. Layout keys (tp, pp, recompute, ...) and keys
    that change neither memory nor time (lr, save, ...) stay left to the search."""
    from engine.base import ConfigError
    from engine.config.fields import field_table
    table = field_table()
    bad = [k for k in UNMODELLED if k in recipe and recipe[k] != table[k].default]
    if bad:
        raise ConfigError("the recipe sets " + ", ".join(f"{k}: {recipe[k]}" for k in bad)
                          + f" ({'; '.join(UNMODELLED[k] for k in bad)}), which the planner does "
                          f"not model; remove {'it' if len(bad) == 1 else 'them'} from --config "
                          f"to plan, and add {'it' if len(bad) == 1 else 'them'} to the printed "
                          f"command")
    given = set(typed)
    for key, (dest, meaning) in RECIPE_SHARED.items():
        if key not in recipe or dest in typed:
            continue
        value = recipe[key] if meaning is None else meaning[recipe[key]]
        if key == "precision" and value not in ("bf16", "fp16"):
            raise ConfigError(f"the recipe's precision: {value}: the planner plans bf16 or fp16 "
                              f"runs (--precision)")
        setattr(args, dest, value)
        given.add(dest)
    if getattr(args, "offload", None) == "on" and "zero" not in typed:
        args.zero = "on"   # the offload moves the distributed optimizer's state: it needs ZeRO
    return frozenset(given)


def typed_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> frozenset[str]:
    """The destinations of the arguments ``argv`` gives (not those left at their defaults), read
    by ``parser`` with every default suppressed; give a parser of its own (it is changed)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


def changed_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> frozenset[str]:
    """The shared arguments whose value is not ``parser``'s default: ``typed_flags``'s stand-in
    where the command line is not at hand (a namespace built by a caller)."""
    return frozenset(d for d in SHARED if getattr(args, d, None) != parser.get_default(d))


def shared_values(args: argparse.Namespace, typed: frozenset[str]) -> dict:
    """engine.train's fields that the planner's typed shared flags set, as engine.train reads
    them, and the precision the printed command passes (always)."""
    values = {"precision": args.precision}
    for dest, (name, meaning) in SHARED.items():
        if dest not in typed:
            continue
        value = getattr(args, dest)
        if meaning is not None:
            if value not in meaning:
                continue
            value = meaning[value]
        values[name] = value
    return values


def check_shared(args: argparse.Namespace, typed: frozenset[str], model: dict) -> None:
    """engine.train's configuration checks on the planned run's shared flags and ``model`` (the
    model fields and --global-batch-size given): ConfigError with engine.train's line."""
    values = {**model, **shared_values(args, typed)}
    if values.get("tp_comm_overlap"):   # --sequence-parallel both: planned on (module docstring)
        values.setdefault("sequence_parallel", True)
    values.setdefault("micro_batch_size", 1)  # searched: any divisor of the batch
    config_from_values(values, values)


def command_notes(command: list[str], args: argparse.Namespace, typed: frozenset[str],
                  model: dict, world_size: int, backend: str) -> list[str]:
    """engine.train's notes on the user's flags (shared and model) in the run ``command`` starts
    (the engine.train arguments of the best layout): each that has no effect there. First
    ``command`` itself goes through engine.train's parser (ConfigError: engine.train's line).
    ``model``: the model fields given (the command carries them); ``backend``: the planned
    cluster's (hccl: an NPU, gloo: the CPU, else a GPU)."""
    parse_args(command)
    shared = shared_values(args, typed - set(SEARCHED))
    shared.pop("precision")               # the command's own, always read: never noted
    over = dict(shared)                   # laid over the command, which leaves out what it drops
    if over.get("tp_comm_overlap"):       # at tp 1 the command has no --sequence-parallel
        over.setdefault("sequence_parallel", True)
    cfg = parse_args(command + [t for name, value in over.items()
                                for t in shlex.split(shown(name, value))])
    cfg = replace(cfg, explicit=tuple(sorted({*shared, *model})))
    grid = cfg.parallel.grid(world_size)
    rope = getattr(default_registry().resolve(cfg.model.block), "position", None) == "rope"
    return unused_flag_notes(cfg, grid, DEVICE_TYPES.get(backend, "cuda"), rope)
