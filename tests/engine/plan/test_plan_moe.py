"""The planner with mixture-of-experts layers: memory against a count of the model's tensors,
the dispatch traffic against the tokens a step routes, the all-to-all time over the links the EP
ranks span, ep in the search and in every printed line and command, and a Mixtral-8x7B-class
model planned on 512 H100s (its published 46.7B parameters)."""
import json
import shlex
from dataclasses import replace

import pytest

from engine.plan import search as plan
from engine.tools import plan_cli
from engine.plan.flops import MoEShape
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
    assert plan_cli.main(MOE_ARGS + ["--json", "--top", "200"]) == 0
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
    assert plan_cli.main(MOE_ARGS + ["--top", "5", "--explain"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith(("tp=", "layout tp="))]
    assert len(lines) == 10 and all(" ep=" in ln for ln in lines)
    assert "  ep_comm " in out and out.rstrip().splitlines()[-1].count("--ep ") == 1
    # a pinned size; a bad one says so in one line
    assert plan_cli.main(MOE_ARGS + ["--json", "--ep", "2"]) == 0
    assert {json.loads(ln)["ep"] for ln in capsys.readouterr().out.splitlines()} == {2}
    for bad, message in ((["--ep", "0"], "--ep expects a comma list of positive integers"),
                         (["--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1"),
                         (["--num-experts", "0"], "--num-experts must be a positive integer")):
        assert plan_cli.main(MOE_ARGS + bad) == 2
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
    # by hand: 6 FLOPs per token and active matrix weight (the embedding lookup is none, the
    # output layer is), and Q K^T, scores x V: 4 s h per token and layer, x 3 for the step
    tokens = 1024 * 4096
    assert best.flops.model == pytest.approx(6 * tokens * (active - 32000 * 4096)
                                             + 3 * tokens * 4 * 4096 * 4096 * 32, rel=1e-12)
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


def test_expert_tensor_parallel_memory_splits_every_expert_over_tp():
    """ETP = tp: each TP rank holds 1/tp of every expert matrix and fc1 bias and the whole fc2
    bias (models/moe/experts.py); ETP = 1 whole replicas on every TP rank. The gradients and
    optimizer state follow, ZeRO sharding the experts' over EDP = dp x cp / ep either way."""
    for tp, ep in ((2, 2), (4, 1), (2, 4)):
        lay = Layout(tp=tp, pp=1, dp=4, ep=ep)
        whole = E // ep * (FE * H + FE + H * FE + H)             # ETP 1: the tensor count's
        split = E // ep * (FE * H // tp + FE // tp + H * FE // tp + H)
        dense, expert = tensor_count(tp, ep, [0, 1, 2, 3], True, True)
        assert expert == 2 * whole
        assert stage_param_split(SMALL, lay, 0) == (dense, 2 * whole)
        etp = replace(lay, etp=tp)
        assert stage_param_split(SMALL, etp, 0) == (dense, 2 * split)
        mem = stage_memory(SMALL, replace(etp, zero=True), 0)
        assert mem.weights == 2 * (dense + 2 * split)
        assert mem.optimizer == 12 * dense / 4 + 12 * 2 * split / (4 // ep)
        assert replace(etp, zero=True).edp == 4 // ep
    llama = replace(SMALL, block="llama")
    lay = Layout(tp=2, pp=1, dp=4, ep=2)
    assert stage_param_split(llama, replace(lay, etp=2), 0)[1] * 2 == \
        stage_param_split(llama, lay, 0)[1] == 2 * E // 2 * 3 * H * FE
    c = Cluster.from_device(H100, 8)
    shape = replace(SMALL, global_batch_size=8)
    assert check_layout(shape, c, replace(lay, etp=2)) is None
    for bad, why in ((replace(lay, etp=4, tp=4, dp=2, ep=1), None),
                     (replace(lay, etp=4), "only 1 or tp 2"),
                     (replace(lay, etp=2, sequence_parallel=True), None),
                     (Layout(tp=2, pp=1, dp=4, etp=2), None)):
        got = check_layout(shape, c, bad)
        assert (got is None) if why is None else (why in got), (bad, got)
    assert "needs MoE layers" in check_layout(replace(shape, moe=None, moe_layers=()), c,
                                              Layout(tp=2, pp=1, dp=4, etp=2))


def test_expert_tensor_parallel_traffic_and_time():
    """ETP = tp adds per MoE layer and micro-batch one all-reduce of the combined (T, h) output
    forward and, backward, of the tokens' gradient (T, h) and the router weights' fp32 (T, K)
    gradient, plus once per step the gpt2 experts' fc2-bias gradients over TP (fp32). A MoE
    layer without a shared expert has none of the dense MLP's TP all-reduces."""
    lay = Layout(tp=2, pp=1, dp=4, ep=2, micro_batch_size=2)
    shape = replace(SMALL, global_batch_size=16)
    micro, tokens = 16 // (4 * 2), S * 2
    msg = 2 * tokens * H
    base = step_traffic(shape, lay, 0)
    etp = step_traffic(shape, replace(lay, etp=2), 0)
    per_layer = 2 * msg + 4 * tokens * K
    bias = 2 * E // 2 * H * 4                                   # two MoE layers, E/ep fc2 biases
    assert etp["tp"] - base["tp"] == micro * 2 * per_layer + bias
    assert (etp["ep"], etp["dp"]) == (base["ep"], base["dp"])   # the same rows, the same dense
    split = stage_param_split(shape, replace(lay, etp=2), 0)[1]  # the EDP sum: the slices
    assert etp["edp"] == 4 * split < base["edp"] == 4 * stage_param_split(shape, lay, 0)[1]
    zero = step_traffic(shape, replace(lay, etp=2, zero=True), 0)
    assert zero["tp"] - step_traffic(shape, replace(lay, zero=True), 0)["tp"] == \
        micro * 2 * per_layer + bias / 2                         # the fix-up on the EDP shard
    llama = replace(shape, block="llama")
    assert step_traffic(llama, replace(lay, etp=2), 0)["tp"] - step_traffic(llama, lay, 0)["tp"] \
        == micro * 2 * per_layer                                 # no expert biases
    # without a shared expert the MoE layers issue none of the dense MLP's two all-reduces
    alone = replace(shape, moe=replace(shape.moe, shared_ffn=0))
    assert base["tp"] - step_traffic(alone, lay, 0)["tp"] == micro * 2 * 2 * msg
    # time: the experts' work per rank divides by tp, the all-reduces are TP communication
    c = Cluster.from_device(H100, 8)
    one, split = (moe_layer_change(shape, c, x, layout_links(c, x)) for x in (lay, replace(lay, etp=2)))
    assert split.compute < one.compute and split.tp_comm > one.tp_comm == 0.0
    assert split.ep_comm == one.ep_comm


def test_etp_in_the_search_every_line_and_every_command(capsys):
    from torch.distributed.run import get_args_parser
    from engine.config.cli import parse_args
    assert plan_cli.main(MOE_ARGS + ["--json", "--top", "400"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {row["etp"] for row in rows} == {1, 2, 4, 8} & {row["tp"] for row in rows} | {1}
    split = [row for row in rows if row["etp"] > 1]
    assert split and all(row["etp"] == row["tp"] for row in split)
    assert {row["sequence_parallel"] for row in split} == {True, False}
    for row in split[:10]:
        argv = shlex.split(row["command"])
        cfg = parse_args(get_args_parser().parse_args(argv[1:]).training_script_args)
        assert cfg.parallel.expert_tensor_parallel_size == row["etp"] == cfg.parallel.tp
    for row in rows:
        assert ("--etp " in row["command"]) == (row["etp"] > 1)
    assert plan_cli.main(MOE_ARGS + ["--layout", "2,1", "--etp", "tp", "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("tp=")]
    assert lines and all(" etp=2 " in ln for ln in lines) and "--etp 2 " in out.splitlines()[-1]
    assert plan_cli.main(MOE_ARGS + ["--layout", "2,1", "--etp", "1", "--json"]) == 0
    assert {json.loads(ln)["etp"] for ln in capsys.readouterr().out.splitlines()} == {1}
    assert plan_cli.main(MOE_ARGS + ["--etp", "3"]) == 2
    assert "--etp: expected a comma list" in capsys.readouterr().err


def test_the_planner_reads_the_model_as_the_trainer_does(tmp_path, capsys):
    """Every model flag of engine.train (with its Megatron spellings) is engine.plan's; a training
    recipe is read by the trainer's reader; a grouped-query MoE recipe (Mixtral's kind, small) is
    planned with the shape engine.train would build, and every printed command trains that model;
    an --ep that no layout can have says why."""
    from torch.distributed.run import get_args_parser
    from engine.config.cli import parse_args
    from engine.config.fields import field_table, flag_info
    from engine.training.memory_check import planner_inputs
    options = {o for a in plan_cli.build_parser()._actions for o in a.option_strings}
    for name, info in field_table().items():
        if info.section == "model":
            assert {"--" + name.replace("_", "-"), *flag_info(name).aliases} <= options, name
    recipe = tmp_path / "moe.yaml"
    recipe.write_text("model:\n  block: llama\n  num_layers: 4\n  hidden_size: 256\n"
                      "  num_attention_heads: 8\n  num_query_groups: 2\n  vocab_size: 1000\n"
                      "  seq_length: 256\n  num_experts: 8\n  moe_router_topk: 2\n"
                      "  moe_layer_freq: '[0,1,1,1]'\n  qk_layernorm: true\n  rope_base: 500000.0\n"
                      "data:\n  global_batch_size: 64\n  mock_data: true\noptim:\n  lr: 1.0e-4\n")
    cluster = ["--device", "h100", "--devices", "16"]
    args = plan_cli.build_parser().parse_args(["--config", str(recipe)] + cluster)
    shape = plan_cli.shape_from_args(args)
    trainer_cfg = parse_args(["--config", str(recipe)])
    want, _ = planner_inputs(trainer_cfg, trainer_cfg.parallel.grid(1))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size", "seq_length", "global_batch_size", "moe",
                "moe_layers"):
        assert getattr(shape, key) == getattr(want, key), key
    assert plan_cli.main(["--config", str(recipe)] + cluster + ["--json", "--top", "5"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 5
    for row in rows:
        cfg = parse_args(get_args_parser().parse_args(shlex.split(row["command"])[1:])
                         .training_script_args)
        for key in ("num_query_groups", "qk_layernorm", "rope_base", "num_experts",
                    "moe_router_topk", "ffn_hidden_size"):
            assert getattr(cfg.model, key) == getattr(trainer_cfg.model, key), key
        assert [cfg.model.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    # the same with flags, Megatron's spellings among them
    flags = ["--block", "llama", "--num-layers", "4", "--hidden", "256", "--heads", "8",
             "--num-query-groups", "2", "--vocab-size", "1000", "--seq-len", "256", "--gbs", "64",
             "--num-experts", "8", "--moe-layer-freq", "[0,1,1,1]", "--qk-layernorm",
             "--rotary-base", "500000"]
    assert plan_cli.main(flags + cluster + ["--json", "--top", "5"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows
    for extra, message in (
            (["--ep", "3"], "--ep 3 does not divide --num-experts 8: each expert-parallel rank "
                            "holds num_experts / ep whole experts; choose a divisor of 8"),
            (["--ep", "8", "--devices", "4"],
             "--ep 8: no layout of --devices 4 has dp x cp divisible by it (expert-parallel groups "
             "are cut from the dp x cp ranks of a pipeline stage); choose an ep that divides dp x "
             "cp, or more devices"),
            (["--ep", "4", "--layout", "2,4"], "--ep 4: no layout of --devices 16 with --layout "
                                               "2,4 has dp x cp divisible by it"),
            (["--num-query-groups", "3"], "--num-query-groups 3 must be a positive divisor of "
                                          "--num-attention-heads 8")):
        assert plan_cli.main(flags + cluster + extra) == 2, extra
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"gridtron: {message}"), err
    dense = flags[:flags.index("--num-experts")]
    assert plan_cli.main(dense + cluster + ["--ep", "2"]) == 2
    assert capsys.readouterr().err == ("gridtron: --ep 2: expert parallelism splits "
                                       "mixture-of-experts layers, and this model has none (add "
                                       "--num-experts E, or drop --ep)\n")


def test_what_the_engine_adds_to_moe_layers():
    """engine/plan/moe_time.py: per MoE layer and micro-batch the launches of its routing kernels
    (one overhead per forward, backward and recomputed forward), under EP one host wait per
    forward, and under EP the busiest rank's extra work at a load imbalance; none of it at ep 1
    but the launches."""
    from engine.plan.model import HOST_WAIT_S, MOE_PASS_OVERHEAD_S
    c = Cluster.from_device(H100, 8)
    shape = replace(SMALL, global_batch_size=8)
    for lay, passes, waits in ((Layout(tp=1, pp=1, dp=8), 2, 0), (Layout(tp=1, pp=1, dp=8, ep=4), 2, 1),
                               (Layout(tp=1, pp=1, dp=8, ep=4, recompute="full"), 3, 2)):
        change = moe_layer_change(shape, c, lay, layout_links(c, lay))
        assert change.moe_overhead == pytest.approx(passes * MOE_PASS_OVERHEAD_S + waits * HOST_WAIT_S)
        assert change.moe_imbalance == 0.0                      # balanced by default
        est = estimate(shape, c, lay)                           # 2 MoE layers, 1 micro-batch
        assert est.time.moe_overhead == pytest.approx(2 * change.moe_overhead)
    lay = Layout(tp=1, pp=1, dp=8, ep=4)
    skewed = replace(c, moe_load_imbalance=1.5)
    base, more = (moe_layer_change(shape, x, lay, layout_links(x, lay)) for x in (c, skewed))
    rate = c.peak_tflops * 1e12 * c.achievable_fraction
    experts = 3 * 2 * H * S * 2 * K * FE / rate                 # gpt2: 2 matrices, fwd + bwd
    assert more.moe_imbalance == pytest.approx(0.5 * (experts + base.ep_comm), rel=1e-9)
    ep1 = Layout(tp=1, pp=1, dp=8)
    assert moe_layer_change(shape, skewed, ep1, layout_links(skewed, ep1)).moe_imbalance == 0.0
    with pytest.raises(ValueError, match="load imbalance"):
        replace(c, moe_load_imbalance=0.5)


def test_calibration_fits_the_moe_terms_to_a_measured_run(tmp_path):
    """calibrate_moe: a dense run of the same active FLOPs gives the achievable fraction, the MoE
    run's imbalance is taken, and the overhead is fitted so the model predicts the measured
    step; here both runs are what the model itself predicts at known values, which the fit must
    find again."""
    from engine.plan.calibrate_moe import calibrate_moe, dense_equivalent
    c = Cluster.from_device(H100, 1)
    moe = ModelShape(2, 1024, 16, 51200, 2048, 16, 4096, "gpt2", fused_attention=True,
                     moe=MoEShape(2, 8, 2, 4096), moe_layers=(0, 1))
    lay = Layout(tp=1, pp=1, dp=1, micro_batch_size=4)
    dense = dense_equivalent(moe)
    assert dense.ffn_hidden_size == 8192 and dense.moe is None
    truth = replace(c, achievable_fraction=0.5, moe_pass_overhead_s=0.4e-3, moe_load_imbalance=1.2)

    def write(path, step, imbalance=None):
        rec = [{"step": i, "step_time_s": step, "moe_load_imbalance": imbalance} for i in (1, 2, 3)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rec))
        return str(path)
    dense_file = write(tmp_path / "dense.jsonl", estimate(dense, truth, lay).step_time_s)
    moe_file = write(tmp_path / "moe.jsonl", estimate(moe, truth, lay).step_time_s, 1.2)
    fitted, notes = calibrate_moe(moe, c, lay, moe_file, dense_file)
    assert fitted.achievable_fraction == pytest.approx(0.5, rel=1e-6)
    assert fitted.moe_load_imbalance == 1.2 and len(notes) == 3
    assert fitted.moe_pass_overhead_s == pytest.approx(0.4e-3, rel=1e-6)
    # without the dense run the fraction is the cluster's, and the overhead absorbs the rest
    alone, _ = calibrate_moe(moe, c, lay, moe_file)
    assert alone.achievable_fraction == c.achievable_fraction
    assert estimate(moe, alone, lay).step_time_s == pytest.approx(
        estimate(moe, truth, lay).step_time_s, rel=1e-6)
    with pytest.raises(ValueError, match="every layer is an MoE layer"):
        dense_equivalent(SMALL)
