"""Preflight: the pure pieces (busbw, sizes, fingerprint comparison) and real torchrun launches on gloo."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tools.commbench import (BenchConfig, bandwidths, bus_factor, format_size, message_elements,
                              parse_size, parse_sizes, plan)
from engine.tools.preflight import (comm_environment, find_mismatches, fingerprint, format_ranks,
                                    local_device_problem, node_layout_problems)
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).parent / "torchrun"


# ---- bandwidth arithmetic --------------------------------------------------------------------------
@pytest.mark.parametrize("op,n,factor", [("all_reduce", 8, 1.75), ("all_reduce", 2, 1.0),
                                         ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875),
                                         ("send_recv", 2, 1.0), ("all_reduce", 1, 0.0)])
def test_bus_factor_matches_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor, rel=1e-15)


def test_bandwidths_in_gb_per_s():
    algbw, busbw = bandwidths("all_reduce", 4, 2_000_000_000, 0.5)
    assert algbw == pytest.approx(4.0, rel=1e-15)
    assert busbw == pytest.approx(4.0 * 2 * 3 / 4, rel=1e-15)
    assert bandwidths("send_recv", 2, 10**9, 2.0) == (0.5, 0.5)
    with pytest.raises(ValueError, match="unknown op"):
        bus_factor("broadcast", 4)


def test_sizes_parse_and_print():
    assert parse_sizes("1K,64K,1M,16M") == (1024, 65536, 1 << 20, 16 << 20)
    assert parse_size("512") == 512 and parse_size("2g") == 2 << 30 and parse_size("4KB") == 4096
    assert [format_size(s) for s in (1024, 65536, 1 << 20, 1000, 3 << 30)] == ["1K", "64K", "1M", "1000B", "3G"]
    for bad in ("", "0", "-1K", "1T", "K"):
        with pytest.raises(ValueError, match="not a positive size"):
            parse_size(bad)


def test_message_elements_split_evenly():
    assert message_elements("all_reduce", 3, 1024, 4) == 256
    assert message_elements("all_gather", 3, 1024, 4) == 255  # 256 rounded down to a multiple of 3
    assert message_elements("reduce_scatter", 8, 4, 4) == 8  # never less than one element per rank
    assert message_elements("send_recv", 2, 10, 4) == 2


def test_bench_config_and_plan():
    with pytest.raises(ValueError, match="--ops"):
        BenchConfig(ops=("all_to_all",))
    with pytest.raises(ValueError, match="--iters"):
        BenchConfig(iters=0)
    cfg = BenchConfig(sizes=(1024, 2048), ops=("all_reduce", "send_recv"))
    steps = plan(ParallelState(RankGrid(tp=2, pp=2, dp=1)), cfg)
    assert steps == [("all_reduce", "tp", 1024), ("all_reduce", "tp", 2048),
                     ("send_recv", "pp", 1024), ("send_recv", "pp", 2048)]
    assert plan(ParallelState(RankGrid(tp=1, pp=1, dp=1)), cfg) == []


# ---- flags refused before any work -----------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--json", "{tmp}"], ["--json", "{tmp}/"],
                                   ["--json", "{tmp}/file/x.json"], ["--timeout", "nan"],
                                   ["--timeout", "inf"], ["--timeout", "0"], ["--timeout", "-5"]])
def test_bad_json_or_timeout_is_one_line_before_any_work(flags, tmp_path, capsys, monkeypatch):
    """A --json that cannot be written (a directory, a path under a file) or a --timeout that is
    not a finite positive number of seconds: exit 2 with one line, before the process group (and
    so before any measurement that the bad path would lose)."""
    from engine.tools import preflight
    (tmp_path / "file").write_text("")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    def no_work(*args, **kwargs):
        raise AssertionError("the process group was started")
    monkeypatch.setattr(preflight.ParallelState, "initialize", no_work)
    argv = ["--device", "cpu"] + [f.format(tmp=tmp_path) for f in flags]
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gridtron: ") and flags[0] in err[0], err


# ---- fingerprints ----------------------------------------------------------------------------------
def _prints(n=16, per_node=8, **per_rank):
    """n ranks on nodes of per_node; per_rank[key] is a function rank -> value (None: key absent)."""
    prints = []
    for r in range(n):
        fp = {"host": f"node{r // per_node}", "local_rank": r % per_node, "torch": "2.1.0",
              "local_world_size": per_node, "HCCL_BUFFSIZE": "200", "HCCL_IF_IP": f"10.0.0.{r // per_node}"}
        for key, fn in per_rank.items():
            value = fn(r)
            if value is None:
                fp.pop(key, None)
            else:
                fp[key] = value
        prints.append(fp)
    return prints


def test_format_ranks():
    assert format_ranks([4]) == "rank 4"
    assert format_ranks([3, 0, 1, 2, 5, 7, 8]) == "ranks 0-3,5,7-8"


def test_uniform_cluster_has_no_mismatch():
    prints = _prints()
    assert find_mismatches(prints) == []  # HCCL_IF_IP differs between nodes, as it must
    assert node_layout_problems(prints) == []


def test_mismatch_names_ranks_and_values():
    prints = _prints(HCCL_BUFFSIZE=lambda r: "200" if r < 8 else None,
                     torch=lambda r: "2.1.0+npu" if r == 13 else "2.1.0")
    assert find_mismatches(prints) == [
        "torch: ranks 0-12,14-15 have 2.1.0, rank 13 has 2.1.0+npu",
        "HCCL_BUFFSIZE: ranks 0-7 have 200, ranks 8-15 have unset"]


def test_node_scoped_key_compared_inside_a_node_only():
    prints = _prints(HCCL_IF_IP=lambda r: "10.0.0.9" if r in (9, 10) else f"10.0.0.{r // 8}")
    assert find_mismatches(prints) == [
        "HCCL_IF_IP on node node1: ranks 8,11-15 have 10.0.0.1, ranks 9-10 have 10.0.0.9"]


def test_local_world_size_and_node_layout():
    prints = _prints(local_world_size=lambda r: 8 if r < 8 else 4)
    assert find_mismatches(prints) == ["local_world_size: ranks 0-7 have 8, ranks 8-15 have 4"]
    assert "node node1 runs 8 processes (ranks 8-15) but LOCAL_WORLD_SIZE is 4" in node_layout_problems(prints)[0]
    interleaved = _prints(n=8, per_node=4, host=lambda r: f"node{r % 2}", local_rank=lambda r: r // 2)
    problems = node_layout_problems(interleaved)
    assert len(problems) == 2 and "node node0 holds ranks 0,2,4,6, not one block of 4" in problems[0]
    shuffled = _prints(n=4, per_node=4, local_rank=lambda r: 3 - r)
    assert node_layout_problems(shuffled) == [
        "node node0: local ranks [3, 2, 1, 0] for ranks 0-3; expected 0..3 in rank order"]


def test_uneven_slurm_nodes_agree_with_their_node_sizes():
    """srun over nodes of 8 and 7 processes (SLURM_TASKS_PER_NODE=8,7): each node's own
    LOCAL_WORLD_SIZE is consistent, not a mismatch; a count that its node does not share, or that
    is not its node's size, still is."""
    def uneven(**per_rank):
        return _prints(n=15, per_node=8, **{"local_world_size": lambda r: 8 if r < 8 else 7,
                                            "node_sizes": lambda r: "8,7", **per_rank})
    prints = uneven()
    assert find_mismatches(prints) == [] and node_layout_problems(prints) == []
    assert fingerprint(LaunchEnv(8, 15, 0, 7, (8, 7)), "cpu", None, "cpu", {})["node_sizes"] == "8,7"
    assert "node_sizes" not in fingerprint(LaunchEnv(8, 16, 0, 8), "cpu", None, "cpu", {})

    odd_one = uneven(local_world_size=lambda r: 8 if r < 8 or r == 12 else 7)
    assert find_mismatches(odd_one) == [
        "local_world_size on node node1: ranks 8-11,13-14 have 7, rank 12 has 8"]
    not_its_size = uneven(local_world_size=lambda r: 7)   # node 0 reads the wrong entry
    assert node_layout_problems(not_its_size) == [
        "node node0 (ranks 0-7) has LOCAL_WORLD_SIZE 7 but SLURM_TASKS_PER_NODE gives it 8 "
        "processes: use srun's block distribution"]
    assert node_layout_problems(uneven(node_sizes=lambda r: "8,4,3"))[0] == (
        "2 node(s) by host name but SLURM_TASKS_PER_NODE describes 3 (8,4,3): give every node its "
        "own hostname")
    other_sizes = uneven(node_sizes=lambda r: "8,7" if r < 8 else "7,8")
    assert find_mismatches(other_sizes) == [
        "local_world_size: ranks 0-7 have 8, ranks 8-14 have 7",
        "node_sizes: ranks 0-7 have 8,7, ranks 8-14 have 7,8"]


def test_comm_environment_selection():
    env = {"HCCL_BUFFSIZE": "200", "NCCL_ALGO": "Ring", "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_DEBUG": "INFO",
           "ASCEND_GLOBAL_LOG_LEVEL": "3", "ASCEND_RT_VISIBLE_DEVICES": "0", "MASTER_ADDR": "n0", "PATH": "/bin",
           "ASCEND_LAUNCH_BLOCKING": "0"}
    got = comm_environment(env)
    assert got["HCCL_BUFFSIZE"] == "200" and got["NCCL_ALGO"] == "Ring" and got["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert got["ASCEND_LAUNCH_BLOCKING"] == "0" and got["HCCL_EXEC_TIMEOUT"] is None
    for absent in ("NCCL_DEBUG", "ASCEND_GLOBAL_LOG_LEVEL", "ASCEND_RT_VISIBLE_DEVICES", "MASTER_ADDR", "PATH"):
        assert absent not in got


def test_local_device_problem():
    assert local_device_problem("cpu", None, 5, {}) is None
    assert local_device_problem("npu", 8, 7, {}, 8) is None
    # Slurm-style: each task sees only its own device, which it binds as device 0
    assert local_device_problem("cuda", 1, 3, {"CUDA_VISIBLE_DEVICES": "3"}, 4) is None
    msg = local_device_problem("cuda", 2, 3, {"CUDA_VISIBLE_DEVICES": "2,3"}, 4)
    assert "LOCAL_RANK 3" in msg and "CUDA_VISIBLE_DEVICES=2,3" in msg and "share" in msg
    assert "no device" in local_device_problem("npu", 0, 0, {}, 1)


# ---- real launches ---------------------------------------------------------------------------------
def _torchrun(nproc: int, program: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HCCL_", "NCCL_", "GLOO_"))}
    env["PYTHONPATH"] = str(REPO)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), *program]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


def _check_rows(rows: list[dict], expected: set[tuple[str, str, int]], sizes: set[int]) -> None:
    assert {(r["op"], r["group"], r["group_size"]) for r in rows} == expected
    assert len(rows) == len(expected) * len(sizes)
    for r in rows:
        assert r["bytes"] in sizes and r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], r["group_size"]), rel=1e-12)


WRAPPER = """
import os, sys
os.environ["HCCL_BUFFSIZE"] = "100" if os.environ["LOCAL_RANK"] == "1" else "200"
from engine.tools.preflight import main
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_tp2_pp2_writes_json(tmp_path):
    """Four ranks whose HCCL_BUFFSIZE differs (rank 1's), with --allow-mismatch: the mismatch is
    named and the measurement runs on, over TP and PP groups (one torchrun serves both checks)."""
    wrapper = tmp_path / "differ.py"
    wrapper.write_text(WRAPPER)
    out = tmp_path / "links.json"
    proc = _torchrun(4, [str(wrapper), "--tp", "2", "--pp", "2", "--sizes", "1K,64K",
                         "--iters", "2", "--json", str(out), "--allow-mismatch"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MISMATCH HCCL_BUFFSIZE: ranks 0,2-3 have 200, rank 1 has 100" in proc.stdout, proc.stdout
    assert "collective check: every group returned" in proc.stdout
    assert "4 ranks on 1 node(s)" in proc.stdout
    expected = {(op, "tp", 2) for op in ("all_reduce", "all_gather", "reduce_scatter")} | {("send_recv", "pp", 2)}
    _check_rows(json.loads(out.read_text()), expected, {1024, 65536})


def test_torchrun_env_mismatch(tmp_path):
    wrapper = tmp_path / "differ.py"
    wrapper.write_text(WRAPPER)
    out = tmp_path / "links.json"
    args = [str(wrapper), "--sizes", "4K", "--iters", "1", "--json", str(out)]  # 2 ranks: dp=2
    failed = _torchrun(2, args, tmp_path)
    assert failed.returncode != 0
    assert "MISMATCH HCCL_BUFFSIZE: rank 0 has 200, rank 1 has 100" in failed.stdout, failed.stdout + failed.stderr
    assert re.search(r"exitcode\s*:\s*3\b", failed.stdout + failed.stderr)
    assert not out.exists()
    # with --allow-mismatch the run goes on: test_torchrun_tp2_pp2_writes_json
