"""The step's communication keys count exactly the tensors handed over, per traffic kind.

tp=2 x pp=2 (4 gloo ranks), fp32, m micro-batches of (b, s) with hidden h and L layers per stage;
``act`` = b*s*h*4 bytes is one (b, s, h) activation. Global rank 0 is the first stage, TP rank 0.
Payload is what a rank hands over: an all-reduce's or reduce-scatter's input, an all-gather's own
shard, a send's tensor (parallel/runtime/comm.py).

Without sequence parallelism, per micro-batch rank 0 hands to TP collectives: the embedding's
all-reduce (act), two all-reduces per layer in forward (attention and MLP outputs) and two in
backward (the gradients entering the QKV and first MLP projections): (1 + 4L) act; and, receiving
the gradient of its output from stage 1 as 1/tp of it per TP rank (scatter/gather in the pipeline,
Megatron's --scatter-gather-tensors-in-pipeline), the all-gather of its act/2 slice. It sends each
activation as its act/2 slice: pp = m act/2. Nothing to DP (dp=1).

With sequence parallelism the activation is a (b, s/2, h) shard, sent whole: pp = m act/2. Per
micro-batch, forward: the embedding's reduce-scatter (act), per layer the all-gathers of the QKV
and MLP inputs (act/2 each, their own shard) and the reduce-scatters after the attention and MLP
outputs (act each): 3 act per layer. Backward, per layer: the QKV and first MLP inputs gathered
again for the weight gradients (act/2 each: only the shard was saved), their input gradients
reduce-scattered (act each), and the gradients of the two row-parallel outputs all-gathered (act/2
each): 4 act per layer; the embedding's output gradient all-gathered (act/2) and the position
table's, a (1, s/2, h) shard (act/(2b)). Once per step the six replicated vectors of h per layer
(two norms' weight and bias, two row-parallel biases) are summed over TP: 6 h 4 L bytes.
"""
from __future__ import annotations

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

B, S, H, LAYERS, GBS = 2, 32, 64, 4, 8
ARGS = ["--mock-data", "--vocab-size", "512", "--no-progress", "--device", "cpu",
        "--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", "4",
        "--seq-length", str(S), "--global-batch-size", str(GBS), "--micro-batch-size", str(B),
        "--train-iters", "2", "--precision", "fp32", "--lr-warmup-iters", "0", "--peak-tflops", "1",
        "--tp", "2", "--pp", "2"]


def _records(ps):
    return [Trainer(parse_args(ARGS + extra)).train().records
            for extra in ([], ["--sequence-parallel"], ["--no-scatter-gather-tensors-in-pipeline"])]


def test_tp_pp_dp_bytes_are_the_tensors_handed_over():
    plain, sp, whole = run_distributed(_records, grid=RankGrid(tp=2, pp=2))[0]
    m, act = GBS // B, B * S * H * 4
    per_stage = LAYERS // 2
    for r in plain:
        assert r["tp_comm_bytes"] == m * (1 + 4 * per_stage) * act + m * act // 2, r
        assert r["pp_comm_bytes"] == m * act // 2, r
        assert r["dp_comm_bytes"] == 0 and r["dp_comm_wire_bytes"] == 0 and r["cp_comm_bytes"] == 0
    for r in sp:
        per_micro = act * (1 + 7 * per_stage) + act // 2 + act // (2 * B)
        assert r["tp_comm_bytes"] == m * per_micro + 6 * H * 4 * per_stage, r
        assert r["pp_comm_bytes"] == m * act // 2, r
    for r in whole:   # the pre-scatter/gather traffic: whole tensors between stages
        assert r["tp_comm_bytes"] == m * (1 + 4 * per_stage) * act, r
        assert r["pp_comm_bytes"] == m * act, r
