"""``python -m engine.preflight``: confirm that a cluster is uniform, then measure the links a layout uses.

HCCL (and, less strictly, NCCL) expects every node to have the same interconnect topology and the same
communication settings; a node with a different HCCL_BUFFSIZE or a different torch_npu shows up as a
hang or a slow ring hours into a job. Launched with the job's launcher, grid and environment, this:

1. gathers a fingerprint from every rank (software versions, device type/name/count, processes per
   node, communication variables) and has rank 0 name every key on which ranks differ, with the ranks
   and their values; it also checks that each node holds one block of LOCAL_WORLD_SIZE consecutive
   ranks, which the grid's "TP inside a node" arithmetic assumes (on Slurm nodes of different sizes,
   LOCAL_WORLD_SIZE is each node's own entry of SLURM_TASKS_PER_NODE, compared inside the node).
   Any of these fails the run (exit 3) unless --allow-mismatch;
2. runs every collective once on known data in each group (exit 4 on a wrong answer);
3. measures bus bandwidth in the TP and DP groups and between neighbouring pipeline stages
   (engine.tools.commbench) and prints a table; --json writes it for the planner's --calibrate-links.

Scopes: most keys must agree on every rank. HCCL_IF_IP names a node's own address, so it must agree
only among the ranks of one node. device_count must agree everywhere (same topology on every node;
inside a node a difference means per-rank visibility masks); before any collective each rank also
checks that it can see device LOCAL_RANK, which the engine binds. Exit 2: bad flags or layout (one
line, ``gridtron: ...``, as every tool says a user's mistake).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import socket
import sys
import textwrap

import torch

from engine.base import ToolParser, run_tool
from engine.tools.commbench import OPS, BenchConfig, check_collectives, format_table, parse_sizes, run_benchmarks
from engine.config.parallel import ParallelConfig
from engine.device.runtime import detect_device_type, device_count, device_index, setup_device
from parallel.grid.launch import LaunchEnv, LayoutError
from parallel.grid.state import ParallelState

COMM_ENV = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME",
            "HCCL_INTRA_ROCE_ENABLE", "HCCL_INTRA_PCIE_ENABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
            "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_BUFFSIZE",
            "GLOO_SOCKET_IFNAME")  # always listed, "unset" when absent
COMM_ENV_PREFIXES = ("HCCL_", "NCCL_", "TORCH_NCCL_", "GLOO_", "ASCEND_")  # any other variable set
PER_RANK_ENV = ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
NODE_SCOPED = frozenset({"HCCL_IF_IP"})
NOT_COMPARED = frozenset({"host", "local_rank"})
EXIT_BAD_SETUP, EXIT_MISMATCH, EXIT_WRONG_RESULT = 2, 3, 4


# ---- fingerprint (pure except for reading the process's own facts) --------------------------------
def comm_environment(environ: dict[str, str]) -> dict[str, str | None]:
    """Communication variables worth comparing; logging and visibility masks are left out."""
    found = {name: environ.get(name) for name in COMM_ENV}
    for name, value in environ.items():
        if (name.startswith(COMM_ENV_PREFIXES) and name not in PER_RANK_ENV
                and "DEBUG" not in name and "LOG" not in name):
            found[name] = value
    return dict(sorted(found.items()))


def torch_npu_version() -> str:
    if importlib.util.find_spec("torch_npu") is None:
        return "not installed"  # never import it when absent: a broken install can take `import torch` down with it
    try:
        return importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        import torch_npu
        return str(getattr(torch_npu, "__version__", "unknown"))


def visible_device_count(kind: str) -> int | None:
    """Devices of this type the process can see; None for the CPU, where it means nothing."""
    return None if kind == "cpu" else device_count(kind)


def fingerprint(launch: LaunchEnv, kind: str, count: int | None, name: str,
                environ: dict[str, str]) -> dict[str, object]:
    fp: dict[str, object] = {
        "host": socket.gethostname(), "local_rank": launch.local_rank,
        "python": platform.python_version(), "torch": torch.__version__, "torch_npu": torch_npu_version(),
        "device_type": kind, "device_name": name, "device_count": "n/a" if count is None else count,
        "local_world_size": launch.local_world_size}
    if launch.node_sizes:  # nodes of different sizes (Slurm): every rank reads the same list
        fp["node_sizes"] = ",".join(map(str, launch.node_sizes))
    fp.update(comm_environment(environ))
    return fp


def local_device_problem(kind: str, count: int | None, local_rank: int, environ: dict[str, str],
                         local_world_size: int = 1) -> str | None:
    """Why this process cannot bind a device of its own (engine.device.runtime.device_index: LOCAL_RANK
    modulo the visible devices, so one visible device per process, as Slurm gives, is fine)."""
    if count is None:
        return None
    try:
        device_index(local_rank, local_world_size, count)
        return None
    except ValueError as exc:
        masks = ", ".join(f"{k}={environ[k]}" for k in PER_RANK_ENV if k in environ) or "no visibility mask"
        return f"LOCAL_RANK {local_rank}: this process sees {count} {kind} device(s) ({masks}): {exc}"


# ---- comparing fingerprints (pure) -----------------------------------------------------------------
def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> 'ranks 0-3,5'; [4] -> 'rank 4'."""
    ranks, spans = sorted(ranks), []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def show(value: object) -> str:
    if value is None:
        return "unset"
    return "'' (empty)" if value == "" else str(value)


def nodes_of(prints: list[dict]) -> dict[str, list[int]]:
    """host -> its ranks, hosts in order of their first rank."""
    nodes: dict[str, list[int]] = {}
    for rank, fp in enumerate(prints):
        nodes.setdefault(str(fp.get("host")), []).append(rank)
    return nodes


def _compare(key: str, prints: list[dict], ranks: list[int], node: str | None) -> str | None:
    by_value: dict[str, list[int]] = {}
    for r in ranks:
        by_value.setdefault(show(prints[r].get(key)), []).append(r)
    if len(by_value) < 2:
        return None
    where = f" on node {node}" if node is not None else ""
    parts = [f"{format_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {value}" for value, rs in by_value.items()]
    return f"{key}{where}: " + ", ".join(parts)


def node_sizes(prints: list[dict]) -> tuple[int, ...]:
    """The processes on each node, in node order, where every rank read the same uneven sizes from
    the launcher (Slurm's SLURM_TASKS_PER_NODE, ``LaunchEnv.node_sizes``); () otherwise: then every
    node holds LOCAL_WORLD_SIZE processes (ranks that disagree are a mismatch of their own)."""
    values = {fp.get("node_sizes") for fp in prints}
    if len(values) != 1 or not (value := values.pop()):
        return ()
    return tuple(int(v) for v in str(value).split(","))


def find_mismatches(prints: list[dict]) -> list[str]:
    """One line per key (per node, for node-scoped keys) on which ranks differ; prints[r] is rank r's.
    On nodes of different sizes (``node_sizes``) local_world_size is node-scoped too: each node's
    own count, checked against its size by ``node_layout_problems``."""
    keys = list(dict.fromkeys(k for fp in prints for k in fp if k not in NOT_COMPARED))
    scoped = NODE_SCOPED | ({"local_world_size"} if node_sizes(prints) else set())
    lines = []
    for key in keys:
        if key in scoped:
            lines += [m for node, ranks in nodes_of(prints).items()
                      if (m := _compare(key, prints, ranks, node)) is not None]
        elif (m := _compare(key, prints, list(range(len(prints))), None)) is not None:
            lines.append(m)
    return lines


def node_layout_problems(prints: list[dict]) -> list[str]:
    """Each node must hold LOCAL_WORLD_SIZE consecutive ranks, local ranks 0.. in rank order; on
    nodes of different sizes (``node_sizes``) node i (in order of its first rank) holds the next
    node_sizes[i] ranks and has that LOCAL_WORLD_SIZE, as the grid's ``LaunchEnv.node_of`` places them."""
    problems, sizes, nodes = [], node_sizes(prints), nodes_of(prints)
    if sizes and len(sizes) != len(nodes):
        problems.append(f"{len(nodes)} node(s) by host name but SLURM_TASKS_PER_NODE describes "
                        f"{len(sizes)} ({','.join(map(str, sizes))}): give every node its own hostname")
        sizes = ()
    for i, (node, ranks) in enumerate(nodes.items()):
        per_node = int(prints[ranks[0]]["local_world_size"])
        block = list(range(ranks[0], ranks[0] + per_node))
        first = sum(sizes[:i]) if sizes else ranks[0] - ranks[0] % per_node
        if sizes and per_node != sizes[i]:
            problems.append(f"node {node} ({format_ranks(ranks)}) has LOCAL_WORLD_SIZE {per_node} but "
                            f"SLURM_TASKS_PER_NODE gives it {sizes[i]} processes: use srun's block "
                            f"distribution")
        elif len(ranks) != per_node:
            problems.append(f"node {node} runs {len(ranks)} processes ({format_ranks(ranks)}) but "
                            f"LOCAL_WORLD_SIZE is {per_node}: launch that many per node, and give every "
                            f"node its own hostname")
        elif ranks != block or ranks[0] != first:
            how = ("node i after the ranks of nodes 0..i-1 (SLURM_TASKS_PER_NODE)" if sizes
                   else "rank // LOCAL_WORLD_SIZE")
            problems.append(f"node {node} holds {format_ranks(ranks)}, not one block of {per_node} "
                            f"consecutive ranks from rank {first}: the grid places TP groups by {how}; "
                            f"use torchrun's --node-rank or srun's block distribution")
        elif [prints[r]["local_rank"] for r in ranks] != list(range(per_node)):
            problems.append(f"node {node}: local ranks {[prints[r]['local_rank'] for r in ranks]} for "
                            f"{format_ranks(ranks)}; expected 0..{per_node - 1} in rank order")
    return problems


def agreement_summary(prints: list[dict]) -> str:
    nodes = nodes_of(prints)
    same = [f"{k}={show(v)}" for k, v in prints[0].items()
            if k not in NOT_COMPARED and k not in NODE_SCOPED and all(fp.get(k) == v for fp in prints)]
    return (f"preflight: {len(prints)} ranks on {len(nodes)} node(s) ({', '.join(nodes)})\n"
            "agreed on every rank:\n" + textwrap.fill(" ".join(same), 100, initial_indent="  ",
                                                      subsequent_indent="  ", break_on_hyphens=False))


# ---- the run ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="python -m engine.preflight",
                   description="Check that every rank agrees, then measure link bandwidth.")
    p.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--dp", "--data-parallel-size", type=int, default=None, help="default world/(tp*pp)")
    p.add_argument("--order", default="tp-cp-dp-pp", help="rank-grid order, fastest dimension first")
    p.add_argument("--sizes", default="1K,64K,1M,16M", help="message sizes, comma separated")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before timing")
    p.add_argument("--ops", default=",".join(OPS), help="subset of " + ",".join(OPS))
    p.add_argument("--device", default="auto", help="auto, npu, cuda or cpu")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--json", default=None, metavar="OUT", help="write the measurements as a JSON list")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="report differences between ranks but measure anyway")
    return p


def json_problem(path: str) -> str | None:
    """Why ``path`` cannot take the --json measurements (None when it can), checked before any
    work, so that a bad path never loses a measurement; missing parent directories are created
    when it is written, so the nearest existing one must be a writable directory."""
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        return f"--json {path}: names a directory, not a file"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"--json {path}: is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"--json {path}: {parent} is a file, not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"--json {path}: {parent} is not writable"


def args_problem(args: argparse.Namespace) -> str | None:
    """Why the flags cannot run (None when they can): a timeout that is not a finite number of
    seconds above 0, or a --json path that cannot be written."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout must be a finite number of seconds > 0, got {args.timeout}"
    return json_problem(args.json) if args.json is not None else None


def _fail(rank: int, message: str) -> int:
    print(f"gridtron: rank {rank}: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_SETUP


def main(argv: list[str] | None = None) -> int:
    """A bad flag or layout is one line, ``gridtron: ...``, exit 2 (engine/base.py ``run_tool``);
    ranks that differ exit 3, a collective with a wrong result 4."""
    return run_tool(lambda: check(build_parser().parse_args(argv)))


def check(args: argparse.Namespace) -> int:
    launch = LaunchEnv.from_env()
    environ = dict(os.environ)
    try:
        grid = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, order=args.order).grid(launch.world_size)
        cfg = BenchConfig(sizes=parse_sizes(args.sizes), iters=args.iters, warmup=args.warmup,
                          ops=tuple(o.strip() for o in args.ops.split(",") if o.strip()))
        kind = detect_device_type(args.device)
    except ValueError as exc:
        return _fail(launch.rank, str(exc))
    if (problem := args_problem(args)):
        return _fail(launch.rank, problem)  # before any work: a bad flag loses no measurement
    count = visible_device_count(kind)
    problem = local_device_problem(kind, count, launch.local_rank, environ, launch.local_world_size)
    if problem:
        return _fail(launch.rank, problem)  # before any collective: the launcher ends the other ranks
    dev = setup_device(kind, launch.local_rank, launch.local_world_size)
    try:
        ps = ParallelState.initialize(grid, dev.device, dev.backend, launch, timeout_s=args.timeout)
    except LayoutError as exc:
        return _fail(launch.rank, str(exc))
    main_rank = ps.rank == 0
    prints = ps.world_group.all_gather_object(fingerprint(launch, kind, count, dev.name, environ))
    differences = find_mismatches(prints) + node_layout_problems(prints)
    if main_rank:
        print(agreement_summary(prints))
        for line in differences:
            print(f"MISMATCH {line}")
        print(f"grid: {grid.describe()}, backend {dev.backend}", flush=True)
    if differences and not args.allow_mismatch:
        if main_rank:
            print(f"{len(differences)} difference(s) between ranks: fix them or pass --allow-mismatch",
                  flush=True)
        ps.destroy()
        return EXIT_MISMATCH
    wrong = [f"rank {r}: {p}" for r, probs in enumerate(ps.world_group.all_gather_object(check_collectives(ps))) for p in probs]
    if main_rank:
        print("\n".join(f"WRONG {w}" for w in wrong) or "collective check: every group returned the "
              "expected data", flush=True)
    if wrong:
        ps.destroy()
        return EXIT_WRONG_RESULT
    results = run_benchmarks(ps, dev, cfg)
    if main_rank:
        print(format_table(results) if results else "nothing to measure: every group has one rank")
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump([r.to_json() for r in results], f, indent=1)
            print(f"wrote {len(results)} measurements to {args.json}", flush=True)
    ps.destroy()
    return 0
