"""Cluster planner: ``python -m engine.plan`` ranks parallel layouts by predicted step time.

It enumerates (tp, cp, pp, dp, virtual stages, micro-batch size, recompute, ZeRO-1, sequence
parallelism and, for a mixture-of-experts model, ep and etp: 1 or tp) for the run's rank order (``--order``, default tp-cp-dp-pp; cp = 1 unless ``--cp``),
drops the layouts that break a topology rule (engine/plan/model.check_layout) or do not fit in device
memory, estimates each survivor's step time (engine/plan/timing.py), prints the best first and then
the ``torchrun ... -m engine.train`` command of the best. ``--explain`` prints every term of each
estimate. ``--layout TP,PP[,VP]`` evaluates one layout instead. ``--calibrate`` fits the
achievable-compute fraction to a measured run; ``--calibrate-links`` takes link bandwidths from a
preflight measurement. docs/planner.md explains the model and every constant.

Example (Narayanan et al. 2021, Table 1, 39.1B row)::

    python -m engine.plan --num-layers 48 --hidden-size 8192 --num-attention-heads 64 \\
        --vocab-size 51200 --seq-length 2048 --global-batch-size 1536 \\
        --device a100-80gb --devices 512 --grad-reduce-bytes 2 --attention unfused \\
        --recompute-early-stop off --recompute full --zero off --sequence-parallel off --explain
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from itertools import product

import yaml

from engine.plan.arguments import check_args
# calibration lives in calibrate.py; its functions stay importable from here for existing callers
from engine.plan.calibrate import (fit_achievable_fraction, fit_overlap_efficiency,  # noqa: F401
                                   link_busbw, measured_exposed, measured_step_time)
from engine.plan.hardware import DEVICE_SPECS, get_device_spec
from engine.plan.model import (GIB, MEMORY_USABLE_FRACTION, PLAN_PRECISION, PLAN_SCHEDULES, Cluster,
                               Layout, ModelShape, check_layout)
from engine.plan.placement import DEFAULT_ORDER, parse_order
from engine.plan.report import explain, launch_command, layout_text
from engine.plan.timing import Estimate, estimate

SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
              "global_batch_size", "ffn_hidden_size", "block")
KEY_ALIASES = {"heads": "num_attention_heads", "hidden": "hidden_size", "seq_len": "seq_length",
               "gbs": "global_batch_size"}
# the MoE flags, as engine.train names them (engine/config/flags.py); --ep is the search's
MOE_KEYS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
            "moe_shared_expert_intermediate_size")
JSON_KEYS = ("tp", "cp", "pp", "dp", "ep", "etp", "vp", "schedule", "micro_batch_size", "recompute", "zero",
             "sequence_parallel", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
             "order", "comm_hidden", "memory_bytes_per_device", "step_time_s", "tflops_per_device",
             "model_tflops_per_device", "mfu", "hfu", "time_terms", "memory_terms", "command")


@dataclass(frozen=True)
class SearchSpace:
    """What to enumerate; a fixed value (or a one-element tuple) pins that dimension."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)
    cp: tuple[int, ...] = (1,)
    order: str = DEFAULT_ORDER
    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    micro_batch_size: int | None = None
    schedules: tuple[str, ...] = ("1f1b",)  # with pp > 1; add "zb-h1", "zb-v" to weigh them
    ep: tuple[int, ...] | None = None  # expert-parallel sizes (None: every one that divides)
    # expert tensor parallelism: "1" (whole experts on every TP rank) and/or "tp" (the TP group
    # splits every expert); weighed for MoE models with tp > 1
    etp: tuple[str, ...] = ("1", "tp")
    # the overlaps (Layout's fields, Megatron-LM's flags): --tp-comm-overlap, --overlap-grad-reduce,
    # --overlap-param-gather; the engine's defaults
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def expert_sizes(shape: ModelShape, dp_cp: int, space: SearchSpace) -> list[int]:
    """The ep sizes to weigh: 1 for a dense model, else those of ``space.ep`` (default: every
    one) that divide both dp x cp and the experts."""
    if shape.moe is None:
        return [1]
    wanted = space.ep or _divisors(dp_cp)
    return [ep for ep in wanted if dp_cp % ep == 0 and shape.moe.num_experts % ep == 0]


def expert_tensor_sizes(shape: ModelShape, tp: int, space: SearchSpace) -> list[int]:
    """The etp sizes to weigh for a layout of ``tp`` ranks: 1 and/or tp (``space.etp``) for an
    MoE model with tp > 1, else 1."""
    if shape.moe is None or tp == 1:
        return [1]
    return [1 if v == "1" else tp for v in space.etp]


def candidate_layouts(shape: ModelShape, cluster: Cluster, space: SearchSpace):
    """Every layout of the space that obeys the topology rules (memory is checked later)."""
    n, dpn = cluster.num_devices, cluster.devices_per_node
    for tp, cp, pp in product([space.tp] if space.tp else _divisors(dpn), space.cp,
                              [space.pp] if space.pp else _divisors(shape.num_layers)):
        if n % (tp * cp * pp):
            continue
        dp = n // (tp * cp * pp)
        vps = [space.vp] if space.vp else (_divisors(shape.num_layers // pp) if pp > 1 else [1])
        per_replica = shape.global_batch_size // dp if shape.global_batch_size % dp == 0 else 0
        mbss = [space.micro_batch_size] if space.micro_batch_size else _divisors(per_replica)
        for schedule in space.schedules if pp > 1 else ("1f1b",):
            chunks = {"zb-h1": [1], "zb-v": [2]}.get(schedule, vps)
            for vp, mbs, rc, ep in product(chunks, mbss, space.recompute,
                                           expert_sizes(shape, dp * cp, space)):
                for zero in space.zero if dp * cp > 1 else (False,):
                    for sp in space.sequence_parallel if tp > 1 else (False,):
                        for etp in expert_tensor_sizes(shape, tp, space):
                            layout = Layout(tp, pp, dp, vp, mbs, rc, zero, sp, cp, space.order,
                                            schedule, tp_comm_overlap=space.tp_comm_overlap,
                                            overlap_grad_reduce=space.overlap_grad_reduce,
                                            overlap_param_gather=space.overlap_param_gather,
                                            ep=ep, etp=etp)
                            if check_layout(shape, cluster, layout) is None:
                                yield layout


def search(shape: ModelShape, cluster: Cluster, space: SearchSpace = SearchSpace()) -> list[Estimate]:
    """Estimates of every feasible layout that fits in memory, fastest step first."""
    results = [e for e in (estimate(shape, cluster, lay) for lay in candidate_layouts(shape, cluster, space))
               if e.fits]
    return sorted(results, key=lambda e: e.step_time_s)


# ---- command line ------------------------------------------------------------------------------

def _choice(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    picked = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in picked if v not in allowed]
    if bad or not picked:
        raise ValueError(f"{flag}: expected a comma list of {allowed}, got {value!r}")
    return picked


def _on_off(value: str, flag: str) -> tuple[bool, ...]:
    picked = _choice(value, ("on", "off", "both"), flag)[0]
    return {"on": (True,), "off": (False,), "both": (False, True)}[picked]


HELP_HINT = "python -m engine.plan --help lists every flag"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (main prints it) instead of usage + exit
        raise ValueError(f"{message} ({HELP_HINT})")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.plan", description=__doc__.split("\n\n")[0],
                allow_abbrev=False)
    p.add_argument("--config", help="YAML recipe with the model keys (snake_case or dashed)")
    for key in SHAPE_KEYS:
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=str if key == "block" else int)
    p.add_argument("--attention", default="fused", choices=("fused", "unfused"),
                   help="fused (this engine's flash-style kernels): no s x s scores kept or streamed; "
                        "unfused: Megatron 2021's materialised softmax")
    p.add_argument("--recompute-early-stop", default="on", choices=("on", "off"),
                   help="on: full recomputation skips each layer's last matmul (this engine, "
                        "torch.utils.checkpoint); off: reruns the whole forward (Megatron-LM)")
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
    p.add_argument("--num-experts", type=int, help="experts per MoE layer (a mixture-of-experts "
                                                    "model; engine.train's flag, docs/moe.md)")
    p.add_argument("--moe-router-topk", type=int, help="experts per token (default 2)")
    p.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's width (default "
                                                            "--ffn-hidden-size)")
    p.add_argument("--moe-layer-freq", help="which layers are MoE: N (every N-th) or a 0/1 list")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   help="width of an always-active shared expert")
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
    p.add_argument("--zero", default="both", help="ZeRO-1: on, off or both")
    p.add_argument("--sequence-parallel", default="both", help="on, off or both")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="plan the TP collectives of each layer as chunk rings beside their GEMMs "
                        "(Megatron-LM's flag; with sequence parallelism)")
    p.add_argument("--overlap-grad-reduce", default="on", choices=("on", "off"),
                   help="on (the engine's default): the DP reduction per bucket under the last "
                        "backward; off: all after backward")
    p.add_argument("--overlap-param-gather", default="on", choices=("on", "off"),
                   help="on (the engine's default): ZeRO's all-gather per bucket ahead of the next "
                        "forward; off: waited for after the update")
    p.add_argument("--precision", default=PLAN_PRECISION, choices=("bf16", "fp16"),
                   help="mixed precision of the planned run (both use the half-precision peak)")
    p.add_argument("--data-path", help="data for the printed command (default: --mock-data)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--explain", action="store_true", help="print every term of each estimate")
    p.add_argument("--calibrate", metavar="METRICS_JSONL",
                   help="fit the achievable fraction to a measured run (give its --layout too)")
    p.add_argument("--calibrate-links", metavar="PREFLIGHT_JSON")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    values = {}
    if args.config:
        try:
            with open(args.config) as fh:
                recipe = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ValueError(f"--config {args.config}: not valid YAML{where}: "
                             f"{getattr(exc, 'problem', None) or exc}") from exc
        if not isinstance(recipe, dict):
            raise ValueError(f"--config {args.config}: expected a mapping of keys to values, got "
                             f"a {type(recipe).__name__}")
        for key, value in recipe.items():
            name = str(key).replace("-", "_").lstrip("_")
            name = KEY_ALIASES.get(name, name)
            if name in SHAPE_KEYS + MOE_KEYS:
                values[name] = value
    values.update({k: getattr(args, k) for k in SHAPE_KEYS + MOE_KEYS if getattr(args, k) is not None})
    missing = [k for k in SHAPE_KEYS[:6] if k not in values]
    if missing:
        raise ValueError("missing model keys: " + ", ".join("--" + k.replace("_", "-") for k in missing))
    moe = {k: values.pop(k) for k in MOE_KEYS if k in values}
    shape = ModelShape(**values, fused_attention=args.attention == "fused",
                       recompute_early_stop=args.recompute_early_stop == "on")
    return with_moe(shape, moe) if moe else shape


def with_moe(shape: ModelShape, moe: dict) -> ModelShape:
    """``shape`` with the MoE layers the engine's flags ``moe`` describe: they are checked by the
    engine's own model config (models.config.GPTConfig: --moe-router-topk above --num-experts,
    a --moe-layer-freq list of the wrong length, ...), which also says which layers are MoE."""
    from models.config import GPTConfig
    from engine.plan.flops import moe_shape
    if moe.get("num_experts") is None:
        flags = ", ".join("--" + k.replace("_", "-") for k in moe)
        raise ValueError(f"{flags} configure mixture-of-experts layers, which need --num-experts E")
    if "moe_layer_freq" in moe:
        moe["moe_layer_freq"] = str(moe["moe_layer_freq"])
    cfg = GPTConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                    num_attention_heads=shape.num_attention_heads, vocab_size=shape.vocab_size,
                    seq_length=shape.seq_length, ffn_hidden_size=shape.ffn_hidden_size, **moe)
    found = moe_shape(cfg)
    if found is None:
        return shape
    return replace(shape, moe=found, moe_layers=tuple(i for i in range(cfg.num_layers)
                                                      if cfg.is_moe_layer(i)))


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
    return cluster


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    try:
        cps = tuple(int(x) for x in args.cp.split(",") if x.strip())
    except ValueError:
        cps = ()
    if not cps or min(cps) < 1:
        raise ValueError(f"--cp expects a comma list of positive integers, got {args.cp!r}")
    for cp in cps:
        parse_order(args.order, cp)
    eps = None
    if args.ep is not None:
        try:
            eps = tuple(int(x) for x in args.ep.split(",") if x.strip())
        except ValueError:
            eps = ()
        if not eps or min(eps) < 1:
            raise ValueError(f"--ep expects a comma list of positive integers, got {args.ep!r}")
    etps = _choice(args.etp, ("1", "tp"), "--etp")
    space = SearchSpace(_choice(args.recompute, ("none", "selective", "full"), "--recompute"),
                        _on_off(args.zero, "--zero"), _on_off(args.sequence_parallel, "--sequence-parallel"),
                        cps, args.order, micro_batch_size=args.micro_batch_size,
                        schedules=_choice(args.pipeline_schedule, PLAN_SCHEDULES,
                                          "--pipeline-schedule"),
                        tp_comm_overlap=args.tp_comm_overlap,
                        overlap_grad_reduce=args.overlap_grad_reduce == "on",
                        overlap_param_gather=args.overlap_param_gather == "on", ep=eps, etp=etps)
    if args.layout:
        try:
            parts = [int(x) for x in args.layout.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or min(parts) < 1:
            raise ValueError(f"--layout expects TP,PP[,VP] of positive integers, got {args.layout!r}")
        space = replace(space, tp=parts[0], pp=parts[1], vp=parts[2] if len(parts) == 3 else 1)
    return space


def _explain_empty(shape: ModelShape, cluster: Cluster, space: SearchSpace) -> str:
    if space.tp and space.pp:
        cp = space.cp[0]
        dp = cluster.num_devices // (space.tp * space.pp * cp)
        why = check_layout(shape, cluster, Layout(space.tp, space.pp, max(dp, 1), space.vp or 1,
                                                  space.micro_batch_size or 1, cp=cp, order=space.order))
        if why:
            return f"layout rejected: {why}"
        least = min((estimate(shape, cluster, lay).memory_bytes_per_device
                     for lay in candidate_layouts(shape, cluster, space)), default=None)
        if least is not None:
            usable = cluster.memory_gb * MEMORY_USABLE_FRACTION
            return (f"layout needs at least {least / GIB:.1f} GiB per device, {usable:.1f} GiB usable; "
                    f"try --recompute full, --zero on or a larger pp")
    return "no layout fits in device memory; add devices, allow --recompute full or --zero on"


def _calibrated(args, shape: ModelShape, cluster: Cluster, space: SearchSpace) -> Cluster:
    if not (space.tp and space.pp and space.micro_batch_size and len(space.recompute) == 1
            and len(space.zero) == 1 and len(space.cp) == 1
            and (space.tp == 1 or len(space.sequence_parallel) == 1)):
        raise ValueError("--calibrate needs the measured run's --layout, --micro-batch-size, "
                         "--recompute, --zero, --cp and --sequence-parallel (one value each)")
    layout = next(candidate_layouts(shape, cluster, space), None)
    if layout is None:
        raise ValueError(_explain_empty(shape, cluster, space))
    step = measured_step_time(args.calibrate)
    tflops = estimate(shape, cluster, layout).flops.executed / step / cluster.num_devices / 1e12
    frac = fit_achievable_fraction(shape, cluster, layout, tflops)
    cluster = replace(cluster, achievable_fraction=frac)
    exposed = measured_exposed(args.calibrate)
    for _ in range(50 if exposed else 0):  # the efficiencies at that fraction, the fraction
        before = (frac, cluster.overlap)      # again with them, until neither moves
        cluster = replace(cluster, overlap=fit_overlap_efficiency(shape, cluster, layout, exposed))
        frac = fit_achievable_fraction(shape, cluster, layout, tflops)
        cluster = replace(cluster, achievable_fraction=frac)
        if abs(frac - before[0]) < 1e-9 and cluster.overlap == before[1]:
            break
    print(f"calibrated achievable fraction {frac:.3f} from a measured step of {step:.4g} s "
          f"({tflops:.2f} executed TFLOP/s per device, peak {cluster.peak_tflops})", file=sys.stderr)
    if exposed:
        eff = cluster.overlap
        print(f"calibrated overlap efficiency tp {eff.tp:.3f}, dp {eff.dp:.3f}, zero {eff.zero:.3f} "
              f"from the measured exposed communication ("
              + ", ".join(f"{k} {v:.4g} s" for k, v in exposed.items()) + ")", file=sys.stderr)
    return cluster


def _row_text(est: Estimate) -> str:
    return (f"{layout_text(est.layout)}  "
            f"mem {est.memory_bytes_per_device / GIB:.1f} GiB  step {est.step_time_s:.3f} s  "
            f"{est.tflops_per_device:.1f} TFLOP/s/device  MFU {100 * est.mfu:.1f}%  HFU {100 * est.hfu:.1f}%")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
        shape, cluster, space = shape_from_args(args), cluster_from_args(args), space_from_args(args)
        if args.calibrate:
            cluster = _calibrated(args, shape, cluster, space)
    except OSError as exc:  # a file that went away or cannot be read after the checks
        print(f"engine.plan: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as exc:
        print(f"engine.plan: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    results = search(shape, cluster, space)
    if not results:
        print(_explain_empty(shape, cluster, space), file=sys.stderr)
        return 1
    dpn = cluster.devices_per_node
    for est in results[:args.top]:
        command = launch_command(shape, est.layout, dpn, args.precision, args.data_path)
        if args.json:
            print(json.dumps({**est.as_row(), "command": command}))
            continue
        print(_row_text(est))
        if args.explain:
            print(explain(est, dpn), end="\n\n")
    if not args.json:
        print(f"{'' if args.explain else chr(10)}best layout (rank order {results[0].layout.order}, "
              f"planned in {args.precision}), on every node:\n"
              f"{launch_command(shape, results[0].layout, dpn, args.precision, args.data_path)}")
    return 0
