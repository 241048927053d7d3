"""The planner with mixture-of-experts layers: memory against a count of the model's tensors,
the dispatch traffic against the tokens a step routes, the all-to-all time over the links the EP
ranks span, ep in the search and in every printed line and command, and a Mixtral-8x7B-class
model planned on 512 H100s (its published 46.7B parameters)."""
import json
import shlex
from dataclasses import replace

import pytest

from engine.plan import search as plan
from engine.plan.flops import MoEShape, step_flops
from engine.plan.hardware import DEVICE_SPECS
from engine.plan.memory import stage_memory, stage_param_split
from engine.plan.model import (COLLECTIVE_LATENCY_S, GIB, MEMORY_USABLE_FRACTION, Cluster, Layout,
                               ModelShape, check_layout)
from engine.plan.report import launch_command
from engine.plan.traffic import COUNT_BYTES
from engine.plan.timing import estimate, layout_links, moe_layer_change
from engine.plan.traffic import step_traffic

H100 = DEVICE_SPECS["h100"]
# gpt2 blocks, 4 layers of which 1 and 3 are MoE: 8 experts of width 96, top-2, shared expert 32
H, F, V, S, E, K, FE, FS = 64, 256, 500, 32, 8, 2, 96, 32
SMALL = ModelShape(4, H, 4, V, S, 16, F, "gpt2", moe=MoEShape(2, E, K, FE, FS), moe_layers=(1, 3))


def tensor_count(tp: int, ep: int, layers: list[int], first: bool, last: bool) -> tuple[int, int]:
    """(dense, expert) elements one rank holds, listed tensor by tensor as the engine's gpt2
    model builds them (models/layers.py, models/moe): column-parallel weights and biases split by
    tp, row-parallel biases and norms whole, the router whole, E/ep whole experts."""
    vocab = -(-V // (128 * tp)) * 128 * tp
    dense = expert = 0
    for i in layers:
        dense += 2 * H + 2 * H                                   # two LayerNorms (weight, bias)
        dense += 3 * H * H // tp + 3 * H // tp + H * H // tp + H  # QKV (+bias), proj (+bias)
        if i in (1, 3):
            dense += E * H                                       # the router
            dense += FS * H // tp + FS // tp + H * FS // tp + H  # the shared expert
            expert += E // ep * (FE * H + FE + H * FE + H)       # fc1, fc2 with biases
        else:
            dense += F * H // tp + F // tp + H * F // tp + H     # fc1, fc2 with biases
    if first:
        dense += vocab * H // tp + S * H                          # word and position embeddings
    if last:
        dense += 2 * H + (0 if first else vocab * H // tp)        # final norm, output (tied)
    return dense, expert


def test_memory_of_an_moe_layout_against_a_count_of_its_tensors():
    lay = Layout(tp=2, pp=2, dp=4, ep=2, micro_batch_size=1)
    for stage, layers in ((0, [0, 1]), (1, [2, 3])):
        dense, expert = tensor_count(2, 2, layers, stage == 0, stage == 1)
        assert stage_param_split(SMALL, lay, stage) == (dense, expert)
        mem = stage_memory(SMALL, lay, stage)
        assert mem.weights == 2 * (dense + expert)                # bf16
        assert mem.grads == 4 * (dense + expert)                  # fp32 main gradients
        assert mem.optimizer == 12 * (dense + expert)             # fp32 master, m, v
        # ZeRO: the dense state over dp x cp = 4 ranks, the experts' over their EDP group of 2
        zero = stage_memory(SMALL, replace(lay, zero=True), stage)
        assert zero.optimizer == 12 * dense / 4 + 12 * expert / 2
        assert zero.weights == mem.weights and zero.grads == mem.grads
        zero2 = stage_memory(SMALL, replace(lay, zero=True, zero_stage=2), stage)
        assert zero2.grads == 4 * dense / 4 + 4 * expert / 2
    # every expert of the job exactly once: E per layer over the ep ranks, whatever the ep
    for ep in (1, 2, 4, 8):
        lay = Layout(tp=1, pp=1, dp=8, ep=ep)
        assert stage_param_split(SMALL, lay, 0)[1] * ep == 2 * E * (2 * FE * H + FE + H)
    # a dense model is unchanged by the expert terms
    dense_shape = replace(SMALL, moe=None, moe_layers=())
    assert stage_param_split(dense_shape, Layout(2, 2, 4), 0) == (tensor_count(2, 1, [0, 1], True, False)[0]
                                                                  - E * H - (FS * H // 2 + FS // 2 + H * FS // 2 + H)
                                                                  + F * H // 2 + F // 2 + H * F // 2 + H, 0.0)


def test_dispatch_traffic_is_the_tokens_a_step_routes():
    """Per step a rank routes (gbs / dp) s tokens K times: each copy crosses the dispatch and the
    combine forward and their gradients backward, e h bytes each time; the counts, one int64 per
    expert, are exchanged once per micro-batch and MoE layer forward (again under full
    recomputation, which also re-sends the copies twice)."""
    for mbs, recompute, block in ((1, "none", "gpt2"), (2, "full", "llama"), (4, "selective", "gpt2")):
        shape = replace(SMALL, block=block, global_batch_size=32)
        lay = Layout(tp=2, pp=2, dp=4, ep=4, micro_batch_size=mbs, recompute=recompute)
        tokens = 32 // 4 * S                                    # this rank's tokens per step
        micro = 32 // (4 * mbs)
        copies = 4 + (2 if recompute == "full" else 0)
        counts = 1 + (recompute == "full")
        for stage in (0, 1):
            moe_layers = 1                                      # layer 1 on stage 0, 3 on stage 1
            want = moe_layers * (copies * tokens * K * H * 2 + counts * micro * E * 8)
            traffic = step_traffic(shape, lay, stage)
            assert traffic["ep"] == want, (mbs, recompute, stage)
            dense, expert = tensor_count(2, 4, [2 * stage, 2 * stage + 1], stage == 0, stage == 1)
            if block == "gpt2":
                assert traffic["dp"] == 4 * dense and traffic["edp"] == 0  # EDP of 1: nothing to sum
    # ep 2 over dp 4: the experts' gradients are summed over EDP groups of 2
    lay = Layout(tp=1, pp=1, dp=4, ep=2)
    dense, expert = tensor_count(1, 2, [0, 1, 2, 3], True, True)
    traffic = step_traffic(SMALL, lay, 0)
    assert (traffic["dp"], traffic["edp"]) == (4 * dense, 4 * expert)
    # ep 1: the experts reduce with the rest over dp x cp, no all-to-all
    traffic = step_traffic(SMALL, Layout(tp=1, pp=1, dp=4), 0)
    assert traffic["ep"] == 0 and traffic["edp"] == 0 and traffic["dp"] == 4 * sum(
        tensor_count(1, 1, [0, 1, 2, 3], True, True))


def test_all_to_all_time_over_the_links_the_ep_ranks_span():
    """EP ranks are consecutive members of a stage's dp group: with tp 1 the 8 of ep 8 share a
    node (NVLink), with tp 8 each sits on another node (its network share); (ep-1)/ep of each
    all-to-all leaves the rank, four of them per MoE layer and micro-batch, one latency each,
    plus the count exchange's latency, all exposed."""
    c = Cluster.from_device(H100, 64)
    shape = replace(SMALL, global_batch_size=64)
    rows = 2 * S * K * H                                        # bytes of one all-to-all
    for tp, gbps in ((1, c.intra_busbw_gbps), (8, c.inter_busbw_gbps)):
        lay = Layout(tp=tp, pp=1, dp=64 // tp, ep=8)
        change = moe_layer_change(shape, c, lay, layout_links(c, lay))
        one = 7 / 8 * rows / (gbps * 1e9) + COLLECTIVE_LATENCY_S
        assert change.ep_comm == pytest.approx(4 * one + COLLECTIVE_LATENCY_S, rel=1e-12), tp
        est = estimate(shape, c, lay)
        micro = 64 // (64 // tp)
        assert est.time.ep_comm == pytest.approx(micro * 2 * change.ep_comm, rel=1e-12)
    lay = Layout(tp=1, pp=1, dp=64)
    assert moe_layer_change(shape, c, lay, layout_links(c, lay)).ep_comm == 0.0  # ep 1


def test_expert_rules_refuse_what_the_engine_refuses():
    c = Cluster.from_device(H100, 8)
    ok = Layout(tp=1, pp=1, dp=8, ep=4)
    assert check_layout(replace(SMALL, global_batch_size=8), c, ok) is None
    for lay, why in ((replace(ok, ep=3), "does not divide dp x cp"),
                     (Layout(tp=1, pp=1, dp=8, ep=8), None),
                     (replace(ok, zero=True), None),          # ZeRO shards experts over EDP
                     (Layout(tp=2, pp=1, dp=4, ep=2, sequence_parallel=True), None),
                     (Layout(tp=2, pp=1, dp=2, cp=2, ep=4), "--attention fused")):  # CP's own rule
        got = check_layout(replace(SMALL, global_batch_size=8), c, lay)
        assert (got is None) if why is None else (why in got), (lay, got)
    assert "not divisible by ep 16" in check_layout(
        replace(SMALL, global_batch_size=16), Cluster.from_device(H100, 16), Layout(1, 1, 16, ep=16))
    assert "needs MoE layers" in check_layout(replace(SMALL, moe=None, moe_layers=()), c, ok)


MOE_ARGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--vocab-size", "1000", "--seq-length", "256", "--global-batch-size", "64",
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,0,1]",
            "--moe-shared-expert-intermediate-size", "128", "--device", "h100", "--devices", "16"]


def test_ep_in_the_search_every_line_and_every_command(capsys):
    from torch.distributed.run import get_args_parser
    from engine.config.cli import parse_args
    assert plan.main(MOE_ARGS + ["--json", "--top", "200"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    eps = {row["ep"] for row in rows}
    assert eps > {1} and all(8 % ep == 0 and (row["dp"] * row["cp"]) % row["ep"] == 0
                             for row in rows for ep in [row["ep"]])
    for row in rows[:20]:
        argv = shlex.split(row["command"])
        run = get_args_parser().parse_args(argv[1:])
        cfg = parse_args(run.training_script_args)        # the run's own parser and checks
        assert cfg.parallel.expert_model_parallel_size == row["ep"]
        assert (cfg.model.num_experts, cfg.model.moe_router_topk) == (8, 2)
        assert [cfg.model.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
        assert cfg.model.moe_shared_expert_intermediate_size == 128
        cfg.parallel.grid(16)                              # ep divides dp x cp
    assert plan.main(MOE_ARGS + ["--top", "5", "--explain"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("tp=", "layout tp="))]
    assert len(lines) == 10 and all(" ep=" in ln for ln in lines)
    assert "  ep_comm " in out and out.rstrip().splitlines()[-1].count("--ep ") == 1
    # a pinned size; a bad one says so in one line
    assert plan.main(MOE_ARGS + ["--json", "--ep", "2"]) == 0
    assert {json.loads(ln)["ep"] for ln in capsys.readouterr().out.splitlines()} == {2}
    for bad, message in ((["--ep", "0"], "--ep expects a comma list of positive integers"),
                         (["--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1"),
                         (["--num-experts", "0"], "--num-experts must be a positive integer")):
        assert plan.main(MOE_ARGS + bad) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err


MIXTRAL = ModelShape(32, 4096, 32, 32000, 4096, 1024, 14336, "llama", num_query_groups=8,
                     fused_attention=True, moe=MoEShape(32, 8, 2, 14336))


def test_mixtral_8x7b_on_512_h100s():
    """Mixtral 8x7B (Jiang et al. 2024: 46.7B parameters, 12.9B active per token)."""
    lay = Layout(tp=8, pp=4, dp=16, ep=8)
    total = sum(d * 8 + x * 8 for d, x in (stage_param_split(MIXTRAL, lay, s) for s in range(4)))
    assert total == pytest.approx(46.7e9, rel=0.002)             # dense x tp + experts x ep
    active = (32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 4096 + 2 * 3 * 4096 * 14336)
              + 2 * 32000 * 4096)
    assert active == pytest.approx(12.9e9, rel=0.01)
    c = Cluster.from_device(H100, 512)
    results = plan.search(MIXTRAL, c, plan.SearchSpace(recompute=("none", "full"), zero=(False,),
                                                       sequence_parallel=(False,)))
    best = results[0]
    assert best.layout.ep > 1 and best.fits
    assert best.memory_bytes_per_device <= 80 * GIB * MEMORY_USABLE_FRACTION
    assert best.flops.model == step_flops(1024, 4096, 32, 4096, 32000, 14336, "llama",
                                          best.layout.recompute, moe=MIXTRAL.moe).model
    # the same layout without expert parallelism holds every expert on every rank: 8 x the experts
    alone = estimate(MIXTRAL, c, replace(best.layout, ep=1))
    assert alone.memory.weights > 4 * best.memory.weights and not alone.fits
    assert f"--ep {best.layout.ep} " in launch_command(MIXTRAL, best.layout, 8)


def test_sequence_and_context_parallel_ranks_route_their_own_tokens():
    """Under SP each TP rank routes s b / tp tokens, under CP each rank s b / cp: the dispatch
    bytes per rank shrink by those factors (models/moe/layer.py routes the local shard)."""
    from engine.plan.traffic import ep_per_layer
    base = Layout(tp=2, pp=1, dp=4, ep=2)
    plain = ep_per_layer(SMALL, base) - COUNT_BYTES * SMALL.moe.num_experts
    sp = ep_per_layer(SMALL, replace(base, sequence_parallel=True)) - COUNT_BYTES * SMALL.moe.num_experts
    cp = ep_per_layer(SMALL, replace(base, dp=2, cp=2)) - COUNT_BYTES * SMALL.moe.num_experts
    assert sp == pytest.approx(plain / 2) and cp == pytest.approx(plain / 2)
    assert plain == 4 * SMALL.activation_bytes * SMALL.seq_length * base.micro_batch_size \
        * SMALL.moe.topk * SMALL.hidden_size
