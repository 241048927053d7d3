"""``python -m engine.plan``'s command line (engine/plan/search.py ranks the layouts).

The model is given as ``python -m engine.train`` gives it: every model flag of the trainer's schema
(models/config.py's fields with the help, choices and Megatron spellings of engine/config/flags.py,
e.g. ``--num-query-groups``, ``--num-experts``, ``--moe-layer-freq``, ``--qk-layernorm``) and
``--global-batch-size``, from the flags or a training recipe (``--config``, read by the trainer's
own reader: an unknown key, a duplicate or a value of the wrong type is refused as the trainer
refuses it; keys of the run that do not shape the model, such as ``lr`` or ``tp``, are accepted
and left to the search). The model config is then validated by the model's own checks. The
planner's own flags choose the cluster (``--devices``, ``--device``, ...) and the search space
(``--cp``, ``--ep``, ``--recompute``, ... as comma lists). The flags it shares with engine.train
(``--precision``, ``--fp8-format``, ``--fp8-recipe``, ``--tp-comm-overlap``, ...) go through
engine.train's own checks and notes (engine/tools/train_check.py): refused with engine.train's line,
noted with its note. A mistake is one line, ``gridtron: ...``, exit 2; no layout that fits is one
line and exit 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from engine.base import ConfigError, ToolParser, os_error_text, run_tool
from engine.config.fields import field_table, flag_info
from engine.config.fp8 import blockwise_problem
from engine.config.parallel import ParallelConfig
from engine.config.flags import CONSTANTS
from engine.config.recipe import load_recipe
from engine.plan.arguments import check_args
from engine.plan.calibrate import link_busbw
from engine.plan.flops import BLOCKS, moe_layer_indices, moe_shape, recompute_stops_early
from engine.plan.hardware import DEVICE_SPECS, fp8_peak_problem, get_device_spec
from engine.plan.model import (GIB, HOST_MEMORY_EFFICIENCY, PLAN_PRECISION, PLAN_SCHEDULES, Cluster,
                               Layout, ModelShape)
from engine.plan.placement import DEFAULT_ORDER, parse_order
from engine.plan.report import explain, launch_command, layout_text, train_args
from engine.plan.search import SearchSpace, candidate_layouts, search
from engine.plan.timing import Estimate
from engine.tools.train_check import (apply_recipe, changed_flags, check_shared, command_notes,
                                      typed_flags)
from engine.tools.plan_calibrate import calibrated, explain_empty
from models.config import GPTConfig

# the model's flags (every field of models/config.py) and the one batch flag the planner needs
MODEL_FIELDS = tuple(n for n, info in field_table().items() if info.section == "model")
SHAPE_FIELDS = MODEL_FIELDS + ("global_batch_size",)
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
            "global_batch_size")
JSON_KEYS = ("tp", "cp", "pp", "dp", "ep", "etp", "vp", "schedule", "micro_batch_size", "recompute", "zero",
             "sequence_parallel", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
             "order", "comm_hidden", "memory_bytes_per_device", "step_time_s", "tflops_per_device",
             "model_tflops_per_device", "mfu", "hfu", "time_terms", "memory_terms", "zero_stage",
             "offload", "host_memory_terms", "command")


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    picked = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in picked if v not in allowed]
    if bad or not picked:
        raise ConfigError(f"{flag}: expected a comma list of {allowed}, got {value!r}")
    return picked


def _on_off(value: str, flag: str) -> tuple[bool, ...]:
    picked = _choice(value, ("on", "off", "both"), flag)[0]
    return {"on": (True,), "off": (False,), "both": (False, True)}[picked]


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """engine.train's model flags and --global-batch-size, as its parser defines them."""
    table = field_table()
    group = p.add_argument_group("model (engine.train's flags: python -m engine.train --help)")
    for name in SHAPE_FIELDS:
        info, flag = table[name], flag_info(name)
        flags = ["--" + name.replace("_", "-"), *flag.aliases]
        if info.type is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                               help=flag.help)
        else:
            group.add_argument(*flags, dest=name, type=info.type, choices=flag.choices,
                               help=flag.help)


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="python -m engine.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a training recipe (YAML, engine.train's keys); flags override "
                                    "its model keys")
    _add_model_flags(p)
    p.add_argument("--attention", default="fused", choices=("fused", "unfused"),
                   help="fused (this engine's flash-style kernels): no s x s scores kept or streamed; "
                        "unfused: Megatron 2021's materialised softmax")
    p.add_argument("--recompute-early-stop", default="on", choices=("on", "off"),
                   help="on: full recomputation skips each layer's last matmul as this engine "
                        "does (torch.utils.checkpoint), with --dropout 0 only (a residual "
                        "dropout's mask needs it rerun); off: reruns the whole forward (Megatron-LM)")
    p.add_argument("--device", default="a100-80gb",
                   help=f"one of {', '.join(DEVICE_SPECS)} or a raw device name")
    p.add_argument("--devices", type=int, help="total devices (required)")
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--intra-node-gbps", type=float, help="link rate inside a node, GB/s per direction")
    p.add_argument("--inter-node-gbps", type=float, help="per-device share of the network, GB/s")
    p.add_argument("--peak-tflops", type=float, help="override the table's dense bf16/fp16 peak")
    p.add_argument("--memory-gb", type=float, help="override the table's device memory (GiB)")
    p.add_argument("--achievable-fraction", type=float, help="override the fitted compute fraction")
    p.add_argument("--grad-reduce-bytes", type=int, default=4, choices=(2, 4),
                   help="bytes per gradient element in the DP reduction (4: fp32 main grads)")
    p.add_argument("--order", default=DEFAULT_ORDER,
                   help=f"the run's rank order, fastest first (default {DEFAULT_ORDER}; cp may be "
                        f"left out when cp = 1)")
    p.add_argument("--cp", default="1", help="context-parallel sizes to search, a comma list (default 1)")
    p.add_argument("--layout", help="evaluate one layout: TP,PP[,VP]")
    p.add_argument("--ep", "--expert-model-parallel-size", dest="ep",
                   help="expert-parallel sizes to search, a comma list (default: every size that "
                        "divides dp x cp and the experts)")
    p.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", default="1,tp",
                   help="expert tensor parallelism to weigh for an MoE model with tp > 1: 1 (whole "
                        "experts on every TP rank), tp (the TP group splits every expert) or 1,tp "
                        "(default)")
    p.add_argument("--pipeline-schedule", default="1f1b",
                   help="comma list of pipeline schedules to weigh: 1f1b (interleaved with VP > 1), "
                        "zb-h1, zb-v")
    p.add_argument("--micro-batch-size", type=int, help="pin the micro-batch size")
    p.add_argument("--recompute", default="none,selective,full", help="comma list to search")
    p.add_argument("--zero", default="both",
                   help="the distributed optimizer (ZeRO): on, off or both")
    p.add_argument("--zero-stage", default="1,2,3",
                   help="ZeRO stages the search may use, a comma list (default 1,2,3): each layout "
                        "starts at the lowest; one that does not fit tries the higher ones "
                        "(2: gradients sharded too, 3: and the parameters)")
    p.add_argument("--optimizer-cpu-offload", dest="offload", default="both",
                   choices=("on", "off", "both"),
                   help="the optimizer state in host memory: on (every layout), off, or both "
                        "(default: where a layout does not fit otherwise)")
    p.add_argument("--optimizer-offload-fraction", dest="offload_fraction", type=float, default=1.0,
                   help="with --optimizer-cpu-offload: the share of the optimizer state offloaded "
                        "(default 1.0)")
    p.add_argument("--host-link-gbps", type=float,
                   help="override the table's host link (PCIe) rate, GB/s per direction")
    p.add_argument("--host-memory-gb", type=float,
                   help="host memory per node (GiB) an offloaded optimizer may take, shared by the "
                        "node's devices (default: unbounded); offload fractions whose host part "
                        "exceeds it give way to the largest that fits")
    p.add_argument("--host-memory-gbps", type=float,
                   help="override the table's host DRAM bandwidth per device, GB/s (the host's "
                        "update reaches HOST_MEMORY_EFFICIENCY of it)")
    p.add_argument("--sequence-parallel", default="both", nargs="?", const="on",
                   help="on (also given alone, as engine.train's flag), off or both")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="plan the TP collectives of each layer as chunk rings beside their GEMMs "
                        "(Megatron-LM's flag; engine.train runs it with sequence parallelism "
                        "only, so every layout with tp > 1 is planned with it)")
    p.add_argument("--overlap-grad-reduce", default="on", choices=("on", "off"),
                   help="on (the engine's default): the DP reduction per bucket under the last "
                        "backward; off: all after backward")
    p.add_argument("--overlap-param-gather", default="on", choices=("on", "off"),
                   help="on (the engine's default): ZeRO's all-gather per bucket ahead of the next "
                        "forward; off: waited for after the update")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--precision", default=PLAN_PRECISION, choices=("bf16", "fp16"),
                           help="mixed precision of the planned run (both use the half-precision "
                                "peak)")
    for option, (name, value, text, _) in CONSTANTS.items():  # engine.train's --bf16, --fp16
        if name == "precision":
            precision.add_argument(option, dest="precision", action="store_const", const=value,
                                   help=text)
    p.add_argument("--fp8-format", choices=("e4m3", "hybrid"),
                   help="plan an FP8 run: the tensor-parallel linears' GEMMs at the FP8 peak "
                        "(docs/precision.md); --calibrate on an FP8 run fits their fraction")
    p.add_argument("--fp8-recipe", default="tensorwise", choices=("tensorwise", "rowwise", "blockwise"),
                   help="with --fp8-format: the scales kept in memory")
    p.add_argument("--fp8-peak-tflops", type=float, help="override the table's dense FP8 peak")
    p.add_argument("--fp8-achievable-fraction", type=float,
                   help="the FP8 GEMMs' fraction of the FP8 peak (default: --achievable-fraction's)")
    p.add_argument("--data-path", help="data for the printed command (default: --mock-data)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--explain", action="store_true", help="print every term of each estimate")
    p.add_argument("--calibrate", metavar="METRICS_JSONL",
                   help="fit the achievable fraction to a measured run (give its --layout too); "
                        "for an MoE model the MoE layers' overhead and load imbalance")
    p.add_argument("--calibrate-dense", metavar="METRICS_JSONL",
                   help="with --calibrate of an MoE model: the achievable fraction from a run of "
                        "the dense model with its active FLOPs (MLP width K x the experts')")
    p.add_argument("--calibrate-links", metavar="PREFLIGHT_JSON")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def model_from_args(args: argparse.Namespace) -> tuple[GPTConfig, int, dict]:
    """The model config (validated by its own checks), the global batch size and every shape
    setting given (recipe keys, then flags over them)."""
    given = {}
    if args.config:
        recipe = load_recipe(args.config)  # the trainer's reader: unknown keys, types, duplicates
        given = {k: v for k, v in recipe.items() if k in SHAPE_FIELDS}
    given.update({k: getattr(args, k) for k in SHAPE_FIELDS if getattr(args, k) is not None})
    missing = [k for k in REQUIRED if k not in given]
    if missing:
        raise ConfigError("missing model keys: " + ", ".join("--" + k.replace("_", "-")
                                                             for k in missing))
    try:
        model = GPTConfig(**{k: v for k, v in given.items() if k in MODEL_FIELDS})
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if model.block not in BLOCKS:
        raise ConfigError(f"--block {model.block}: the planner has formulas for the "
                          f"{' and '.join(BLOCKS)} blocks only")
    return model, given["global_batch_size"], given


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The planner's view of the model (engine/plan/model.py), as engine.train would build it."""
    model, gbs, given = model_from_args(args)
    # dropout as engine.train runs the printed command: its default is 0 (no masks kept), and
    # full recomputation stops early only without the residual dropout (flops.py)
    return ModelShape(model.num_layers, model.hidden_size, model.num_attention_heads,
                      model.vocab_size, model.seq_length, gbs, model.ffn_hidden_size, model.block,
                      fused_attention=args.attention == "fused",
                      recompute_early_stop=(args.recompute_early_stop == "on"
                                            and recompute_stops_early(model.dropout)),
                      dropout=model.dropout > 0, attention_dropout=model.attention_dropout_p > 0,
                      num_query_groups=model.num_query_groups, moe=moe_shape(model),
                      moe_layers=moe_layer_indices(model),
                      fp8_recipe=args.fp8_recipe if args.fp8_format else None,
                      max_positions=model.max_position_embeddings, qk_layernorm=model.qk_layernorm,
                      rules=train_rules(args, model))


def train_rules(args: argparse.Namespace, model: GPTConfig) -> tuple:
    """engine.train's layout rules that need its configuration (``ModelShape.rules``): under
    --fp8-recipe blockwise no TP or CP shard may cut a 128 scale tile (engine/config/fp8.py
    ``blockwise_problem`` on the model and each layout's tp and cp, the p2p ring planned)."""
    if not (args.fp8_format and args.fp8_recipe == "blockwise"):
        return ()
    return (lambda layout: blockwise_problem(model, ParallelConfig(tp=layout.tp, cp=layout.cp)),)


def model_flags(args: argparse.Namespace, shape: ModelShape) -> list[str]:
    """The model flags the user set that the printed command does not already carry (e.g.
    ``--qk-layernorm``, ``--rope-base``, the router's choices), so that it trains this model."""
    _, _, given = model_from_args(args)
    written = {a.lstrip("-").replace("-", "_") for a in train_args(shape, Layout(1, 1, 1))
               if a.startswith("--")}
    out = []
    for name, value in given.items():
        if name in written or name not in MODEL_FIELDS:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            out += [flag, str(value)]
    return out


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    spec = get_device_spec(args.device)
    cluster = Cluster.from_device(spec, args.devices, args.devices_per_node, args.intra_node_gbps,
                                  args.inter_node_gbps, args.peak_tflops, args.memory_gb,
                                  grad_reduce_bytes=args.grad_reduce_bytes)
    if args.calibrate_links:
        links = link_busbw(args.calibrate_links)
        cluster = replace(cluster, intra_busbw_gbps=links.get("intra", cluster.intra_busbw_gbps),
                          inter_busbw_gbps=links.get("inter", cluster.inter_busbw_gbps))
    if args.achievable_fraction is not None:
        cluster = replace(cluster, achievable_fraction=args.achievable_fraction)
    if args.fp8_peak_tflops is not None or args.fp8_achievable_fraction is not None:
        cluster = replace(cluster, fp8_peak_tflops=args.fp8_peak_tflops or cluster.fp8_peak_tflops,
                          fp8_achievable_fraction=args.fp8_achievable_fraction)
    if args.host_link_gbps is not None:
        cluster = replace(cluster, host_link_gbps=args.host_link_gbps)
    if args.host_memory_gbps is not None:
        cluster = replace(cluster, host_update_gbps=args.host_memory_gbps * HOST_MEMORY_EFFICIENCY)
    if args.host_memory_gb is not None:
        cluster = replace(cluster, host_memory_gb=args.host_memory_gb)
    if args.fp8_format and (problem := fp8_peak_problem(spec, cluster.fp8_peak_tflops)):
        raise ConfigError(problem)
    return cluster


def _sizes(text: str, flag: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"{flag} expects a comma list of positive integers, got {text!r}")
    return sizes


def _zero_stages(text: str) -> tuple[int, ...]:
    stages = tuple(sorted(set(_sizes(text, "--zero-stage"))))
    if set(stages) - {1, 2, 3}:
        raise ConfigError(f"--zero-stage expects a comma list of 1, 2 and 3, got {text!r}")
    return stages


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    cps = _sizes(args.cp, "--cp")
    for cp in cps:
        parse_order(args.order, cp)
    eps = None if args.ep is None else _sizes(args.ep, "--ep")
    etps = _choice(args.etp, ("1", "tp"), "--etp")
    space = SearchSpace(_choice(args.recompute, ("none", "selective", "full"), "--recompute"),
                        _on_off(args.zero, "--zero"), _on_off(args.sequence_parallel, "--sequence-parallel"),
                        cps, args.order, micro_batch_size=args.micro_batch_size,
                        schedules=_choice(args.pipeline_schedule, PLAN_SCHEDULES,
                                          "--pipeline-schedule"),
                        tp_comm_overlap=args.tp_comm_overlap,
                        overlap_grad_reduce=args.overlap_grad_reduce == "on",
                        overlap_param_gather=args.overlap_param_gather == "on", ep=eps, etp=etps,
                        zero_stages=_zero_stages(args.zero_stage),
                        offload={"off": (0.0,), "on": (args.offload_fraction,),
                                 "both": (0.0, args.offload_fraction)}[args.offload])
    if args.offload == "on" and args.zero == "off":
        raise ConfigError("--optimizer-cpu-offload on moves the distributed optimizer's state to "
                          "host memory: give --zero on (or both)")
    if args.layout:
        try:
            parts = [int(x) for x in args.layout.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or min(parts) < 1:
            raise ConfigError(f"--layout expects TP,PP[,VP] of positive integers, got {args.layout!r}")
        space = replace(space, tp=parts[0], pp=parts[1], vp=parts[2] if len(parts) == 3 else 1)
    return space


def expert_problem(shape: ModelShape, cluster: Cluster, space: SearchSpace) -> str | None:
    """Why no layout can have the asked --ep (None when some can): no experts, an ep that does not
    divide the experts, or no layout whose dp x cp ranks (where EP groups are drawn) it divides."""
    if space.ep is None:
        return None
    eps = ",".join(map(str, space.ep))
    if shape.moe is None:
        return (f"--ep {eps}: expert parallelism splits mixture-of-experts layers, and this model "
                f"has none (add --num-experts E, or drop --ep)")
    experts = shape.moe.num_experts
    if all(experts % ep for ep in space.ep):
        return (f"--ep {eps} does not divide --num-experts {experts}: each expert-parallel rank "
                f"holds num_experts / ep whole experts; choose a divisor of {experts}")
    if next(candidate_layouts(shape, cluster, space), None) is None and \
            next(candidate_layouts(shape, cluster, replace(space, ep=None)), None) is not None:
        pinned = f" with --layout {space.tp},{space.pp}" if space.tp and space.pp else ""
        return (f"--ep {eps}: no layout of --devices {cluster.num_devices}{pinned} has dp x cp "
                f"divisible by it (expert-parallel groups are cut from the dp x cp ranks of a "
                f"pipeline stage); choose an ep that divides dp x cp, or more devices")
    return None


def _row_text(est: Estimate) -> str:
    host = f" (host {est.host.total / GIB:.1f} GiB)" if est.layout.offload else ""
    return (f"{layout_text(est.layout)}  "
            f"mem {est.memory_bytes_per_device / GIB:.1f} GiB{host}  step {est.step_time_s:.3f} s  "
            f"{est.tflops_per_device:.1f} TFLOP/s/device  MFU {100 * est.mfu:.1f}%  HFU {100 * est.hfu:.1f}%")


def plan(args: argparse.Namespace, typed: frozenset[str] | None = None) -> int:
    """Rank the layouts and print them (exit 0), or say that none fits (exit 1). ``typed``: the
    arguments the user gave (engine/tools/train_check.py ``typed_flags``; default: those not at
    their defaults): the flags shared with engine.train go through its checks (refused with its
    line) and its notes (printed as it prints them, ``gridtron: note: ...``)."""
    if typed is None:
        typed = changed_flags(args, build_parser())
    check_args(args)
    if args.config:   # the recipe's run keys where no flag was typed (train_check.apply_recipe)
        typed = apply_recipe(args, typed, load_recipe(args.config))
    shape = shape_from_args(args)
    given = model_from_args(args)[2]
    check_shared(args, typed, given)
    cluster, space = cluster_from_args(args), space_from_args(args)
    if (problem := expert_problem(shape, cluster, space)):
        raise ConfigError(problem)
    if args.calibrate:
        cluster = calibrated(args, shape, cluster, space)
    results = search(shape, cluster, space)
    if not results:
        print(f"gridtron: {explain_empty(shape, cluster, space)}", file=sys.stderr)
        return 1
    dpn, extra = cluster.devices_per_node, model_flags(args, shape)
    if args.fp8_format:
        extra += ["--fp8-format", args.fp8_format, "--fp8-recipe", args.fp8_recipe]
    command = lambda est: launch_command(shape, est.layout, dpn, args.precision,  # noqa: E731
                                         args.data_path, extra)
    best = results[0].layout
    for note in command_notes(train_args(shape, best, args.precision, args.data_path) + extra,
                              args, typed, given, best.world_size, cluster.backend):
        print(f"gridtron: note: {note}", file=sys.stderr)
    for est in results[:args.top]:
        if args.json:
            print(json.dumps({**est.as_row(), "command": command(est)}))
            continue
        print(_row_text(est))
        if args.explain:
            print(explain(est, dpn), end="\n\n")
    if not args.json:
        print(f"{'' if args.explain else chr(10)}best layout (rank order {results[0].layout.order}, "
              f"planned in {args.precision}), on every node:\n{command(results[0])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """A user's mistake (a flag, a recipe, a model the trainer would refuse, an input file) is one
    line, ``gridtron: ...``, exit 2 (engine/base.py ``run_tool``)."""
    return run_tool(lambda: plan(build_parser().parse_args(argv),
                                 typed_flags(build_parser(), argv)),
                    (OSError, lambda e: os_error_text(e), 2),
                    ((ValueError, KeyError), lambda e: e.args[0] if e.args else str(e), 2))
