"""``--compile`` with mixture-of-experts layers: a compiled run under expert parallelism trains the
serial eager model.

dp 2 with ep 2 (each rank holds two of the four experts and exchanges tokens with the other),
llama blocks, one MoE layer with the global aux loss and the z-loss, the alltoall and the
allgather dispatcher (Dynamo breaks the graph where the routing's data-dependent split sizes
reach the host), fp32, 3 steps: the
per-step loss, balancing losses and gradient norm equal the serial eager run's to a relative
1e-5 and the per-expert load exactly. The comm layer does not count collectives inside a compiled
graph: the compiled runs' EP bytes are null, and their DP bytes too (the global aux loss
all-reduces over DP inside the graph), where the eager run's are numbers. Inductor compiles on
every rank, so the model is one layer and the run three steps.
"""
from __future__ import annotations

import pytest
from torch._dynamo.utils import counters as dynamo_counters

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
        "--block", "llama", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--global-batch-size", "4",
        "--train-iters", "3", "--precision", "fp32", "--lr", "1e-2", "--lr-warmup-iters", "0",
        "--peak-tflops", "1", "--timeout-s", "300", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-aux-loss-coeff", "0.05", "--moe-z-loss-coeff", "1e-3"]
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_expert_load")
BYTES = ("ep_comm_bytes", "dp_comm_bytes", "dp_comm_wire_bytes")
LAYOUTS = [["--ep", "2", "--micro-batch-size", "2"],
           ["--ep", "2", "--micro-batch-size", "2", "--moe-token-dispatcher-type", "allgather"]]


def _train(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    graphs = []  # graphs compiled in this process after each step
    one_step = trainer.train_one

    def counted(step):
        record = one_step(step)
        graphs.append(dynamo_counters["stats"]["unique_graphs"])
        return record
    trainer.train_one = counted
    try:
        records = trainer.train().records
        compiled = trainer.cfg.compile
        ep = trainer.ps.ep_group.size
    finally:
        trainer.close()
    return {**{k: [r[k] for r in records] for k in KEYS + BYTES}, "compiled": compiled, "ep": ep,
            "graphs": graphs}


def _compiled(ps, root: str) -> list[dict]:
    # one run directory, so one Inductor cache (run_dir/compile_cache): the second layout finds
    # the graphs the dispatchers share (attention, norms, the router) compiled by the first
    return [_train(flags + ["--dp", "2", "--compile", "--run-dir", f"{root}/compiled",
                            "--save", f"{root}/{i}"])
            for i, flags in enumerate(LAYOUTS)]


def test_compiled_expert_parallel_run_equals_serial_eager(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # the global aux loss over each micro-step's tokens: one micro-batch of 2 per rank, 4 serially
    serial = _train(["--micro-batch-size", "4", "--run-dir", str(tmp_path / "serial")],
                    launch=LaunchEnv())
    runs = run_distributed(_compiled, grid=RankGrid(dp=2), args=(str(tmp_path),), timeout_s=600)
    assert all(isinstance(v, (int, float)) for key in BYTES for v in serial[key]), serial
    for name, got in zip(("alltoall", "allgather"), runs[0]):
        assert got["compiled"] and got["ep"] == 2, name
        assert all(got[key] == [None] * 3 for key in BYTES), (name, {k: got[k] for k in BYTES})
        for key in KEYS[:4]:
            assert got[key] == pytest.approx(serial[key], rel=1e-5), (name, key)
        assert got["moe_expert_load"] == serial["moe_expert_load"], name
        # every graph compiled in the first step: the later steps' other row counts (the split
        # sizes read on the host) recompile nothing
        assert got["graphs"][1:] == got["graphs"][:1] * 2, (name, got["graphs"])
