"""The step's communication keys count exactly the tensors handed over, per traffic kind.

tp=2 x pp=2 (4 gloo ranks), fp32, no sequence parallelism, m micro-batches of (b, s) with hidden h
and L layers per stage. Global rank 0 (first stage, TP rank 0) hands to TP collectives, per
micro-batch: the embedding's all-reduce, two all-reduces per layer in forward (attention and MLP
outputs) and two in backward (the gradients entering the QKV and first MLP projections), each of
b*s*h fp32 values; to the pipeline, one activation per micro-batch; nothing to DP (dp=1).
"""
from __future__ import annotations

from engine.cli import parse_args
from engine.trainer import Trainer
from parallel.topology import RankGrid
from tests.dist_utils import run_distributed

B, S, H, LAYERS, GBS = 2, 32, 64, 4, 8
ARGS = ["--mock-data", "--vocab-size", "512", "--no-progress", "--device", "cpu",
        "--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", "4",
        "--seq-length", str(S), "--global-batch-size", str(GBS), "--micro-batch-size", str(B),
        "--train-iters", "2", "--precision", "fp32", "--lr-warmup-iters", "0", "--peak-tflops", "1",
        "--tp", "2", "--pp", "2"]


def _records(ps):
    return Trainer(parse_args(ARGS)).train().records


def test_tp_pp_dp_bytes_are_the_tensors_handed_over():
    records = run_distributed(_records, grid=RankGrid(tp=2, pp=2))[0]
    m, act = GBS // B, B * S * H * 4
    per_stage = LAYERS // 2
    for r in records:
        assert r["tp_comm_bytes"] == m * (1 + 4 * per_stage) * act, r
        assert r["pp_comm_bytes"] == m * act, r
        assert r["dp_comm_bytes"] == 0 and r["dp_comm_wire_bytes"] == 0 and r["cp_comm_bytes"] == 0
