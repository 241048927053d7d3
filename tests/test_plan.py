"""The cluster planner: memory pieces, topology rules, the CLI and the published Megatron rows."""
import json
from dataclasses import replace

import pytest

from engine.plan import search as plan
from engine.plan.hardware import DEVICE_SPECS
from engine.plan.model import (BYTES_PER_PARAM, GIB, LINK_EFFICIENCY, Cluster, Layout, ModelShape,
                               check_layout, in_flight, layer_activation_bytes, layer_params_per_device,
                               memory_per_device, stage_params)
from engine.plan.timing import COLLECTIVE_LATENCY_S, allreduce_s, estimate, group_busbw

A100 = DEVICE_SPECS["a100-80gb"]


def cluster(devices, **kw):
    return Cluster.from_device(A100, devices, **kw)


# ---- memory pieces -----------------------------------------------------------------------------

def test_layer_activations_match_korthikanti():
    s, b, h, a, t = 2048, 4, 8192, 64, 8
    shape = ModelShape(48, h, a, 51200, s, 1536)
    sbh = s * b * h
    lay = Layout(t, 2, 32, micro_batch_size=b)
    assert layer_activation_bytes(shape, lay) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = replace(lay, sequence_parallel=True)
    assert layer_activation_bytes(shape, sp) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(shape, replace(sp, recompute="selective")) == pytest.approx(34 * sbh / t)
    selective = layer_activation_bytes(shape, replace(lay, recompute="selective"))
    assert selective == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(shape, replace(lay, recompute="full")) == 2 * sbh
    assert layer_activation_bytes(shape, replace(sp, recompute="full")) == 2 * sbh / t


def test_fused_attention_keeps_no_scores():
    shape = ModelShape(48, 8192, 64, 51200, 2048, 1536)
    fused = replace(shape, fused_attention=True)
    lay = Layout(8, 2, 32, micro_batch_size=4)
    selective = layer_activation_bytes(shape, replace(lay, recompute="selective"))
    assert layer_activation_bytes(fused, lay) == selective
    assert memory_per_device(fused, lay).activations < memory_per_device(shape, lay).activations
    assert estimate(fused, cluster(512), lay).step_time_s < estimate(shape, cluster(512), lay).step_time_s


def test_llama_activations_use_three_mlp_tensors():
    shape = ModelShape(4, 64, 4, 100, 32, 8, ffn_hidden_size=96, block="llama")
    lay = Layout(1, 1, 1, micro_batch_size=2, recompute="selective")
    sb = 32 * 2
    assert layer_activation_bytes(shape, lay) == sb * (18 * 64 + 6 * 96)


def test_in_flight_micro_batches():
    shape = ModelShape(32, 64, 4, 100, 32, 64)
    lay = Layout(1, 4, 1, micro_batch_size=1)
    assert [in_flight(shape, lay, r) for r in range(4)] == [4, 3, 2, 1]  # 1F1B: p - rank
    inter = replace(lay, vp=2)
    assert in_flight(shape, inter, 0) == pytest.approx(4 * (1 + 3 / (4 * 2)))
    assert in_flight(shape, Layout(1, 1, 1), 0) == 1
    few = ModelShape(32, 64, 4, 100, 32, 2)  # two micro-batches: never more than two in flight
    assert in_flight(few, lay, 0) == 2


def test_params_and_weight_bytes():
    h, L, V, s = 64, 4, 100, 32
    shape = ModelShape(L, h, 4, V, s, 8)
    first, last = stage_params(shape, Layout(1, 1, 1))
    expected = L * (12 * h * h + 13 * h) + V * h + s * h + 2 * h  # GPT-2, tied embeddings
    assert first == last == expected
    lay = Layout(2, 2, 2, micro_batch_size=4)
    first, last = stage_params(shape, lay)
    assert first == 2 * layer_params_per_device(shape, 2) + V * h / 2 + s * h
    assert last == 2 * layer_params_per_device(shape, 2) + V * h / 2 + 2 * h  # embedding copy
    assert memory_per_device(shape, Layout(1, 1, 1)).weights == expected * BYTES_PER_PARAM
    zero = memory_per_device(shape, Layout(1, 1, 4, zero=True)).weights
    assert zero == pytest.approx(expected * (6 + 12 / 4))


def test_memory_grows_with_in_flight_and_shrinks_with_recompute():
    shape = ModelShape(48, 8192, 64, 51200, 2048, 1536)
    base = Layout(8, 2, 32, micro_batch_size=4)
    none, full = memory_per_device(shape, base), memory_per_device(shape, replace(base, recompute="full"))
    assert full.activations < none.activations and full.weights == none.weights
    one = Layout(8, 1, 64, micro_batch_size=4)
    # first stage of 2 holds 2 micro-batches of 24 layers; a single stage holds 1 of 48
    assert memory_per_device(shape, base).activations > memory_per_device(shape, one).activations * 0.9


# ---- topology rules ----------------------------------------------------------------------------

SHAPE = ModelShape(48, 8192, 64, 51200, 2048, 1536)


@pytest.mark.parametrize("layout,match", [
    (Layout(16, 2, 16), "inside a node"),
    (Layout(3, 1, 170), "tp\\*pp\\*dp"),
    (Layout(8, 4, 16, vp=5), "not divisible by pp\\*vp"),
    (Layout(8, 2, 32, micro_batch_size=5), "global batch"),
    (Layout(8, 1, 64, vp=2), "need pp > 1"),
    (Layout(4, 4, 32), "PP across nodes"),
    (Layout(2, 8, 32), "PP across nodes"),
])
def test_rule_rejections(layout, match):
    why = check_layout(SHAPE, cluster(512), layout)
    assert why is not None and __import__("re").search(match, why), why


def test_more_rejections():
    c = cluster(64)
    assert "heads" in check_layout(ModelShape(8, 96, 12, 100, 64, 64), c, Layout(8, 1, 8))
    # interleaving needs a whole number of rounds of pp micro-batches
    shape = ModelShape(16, 64, 8, 100, 64, 12)
    why = check_layout(shape, cluster(8), Layout(1, 8, 1, vp=2, micro_batch_size=1))
    assert "interleaved" in why  # 12 micro-batches over 8 stages
    assert check_layout(shape, cluster(8), Layout(1, 8, 1, vp=1, micro_batch_size=1)) is None
    assert check_layout(replace(shape, global_batch_size=16), cluster(8), Layout(1, 8, 1, vp=2)) is None
    sp = check_layout(ModelShape(8, 64, 4, 100, 30, 8), cluster(8), Layout(4, 1, 2, sequence_parallel=True))
    assert "sequence" in sp
    with pytest.raises(ValueError, match="tp > 1"):
        Layout(1, 1, 8, sequence_parallel=True)
    with pytest.raises(ValueError, match="whole number of nodes"):
        cluster(12)


def test_placement_accepts_megatron_layouts_and_relaxes_on_request():
    assert check_layout(SHAPE, cluster(512), Layout(8, 2, 32)) is None
    assert check_layout(SHAPE, cluster(512), Layout(2, 1, 256)) is None  # no pipeline: any tp
    assert check_layout(SHAPE, cluster(8), Layout(2, 4, 1)) is None  # one node: PP stays inside
    assert check_layout(SHAPE, cluster(512, relaxed_placement=True), Layout(4, 4, 32)) is None
    relaxed = cluster(24, relaxed_placement=True)
    assert "tile" in check_layout(ModelShape(12, 64, 4, 100, 64, 6), relaxed, Layout(1, 12, 2))


# ---- time pieces -------------------------------------------------------------------------------

def test_collective_formulas():
    assert allreduce_s(1e9, 1, 100.0) == 0.0
    assert allreduce_s(1e9, 8, 100.0) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + COLLECTIVE_LATENCY_S)
    c = cluster(64)
    intra, inter = 300 * LINK_EFFICIENCY, 25 * LINK_EFFICIENCY
    assert group_busbw(c, 1, 8) == intra  # one node
    assert group_busbw(c, 8, 8) == inter  # one member per node
    assert group_busbw(c, 2, 32) == pytest.approx(min(intra, 4 * inter))  # 4 members per node


def test_estimate_parts_add_up_and_bubble_follows_schedule():
    shape = ModelShape(48, 8192, 64, 51200, 2048, 1536)
    c = cluster(512, grad_reduce_bytes=2)
    one = estimate(shape, c, Layout(8, 2, 32, 1, 4, "full"))
    parts = one.parts
    total = (parts["compute"] + parts["bubble"] + parts["imbalance"] + parts["dp_exposed"]
             + parts["zero_allgather"] + parts["optimizer"])
    assert total == pytest.approx(one.step_time_s, rel=1e-9)
    assert parts["bubble"] / (parts["compute"] / 12) == pytest.approx(1.0)  # (p-1)/v = 1 micro-batch
    inter = estimate(shape, c, Layout(8, 2, 32, 4, 4, "full"))
    assert inter.parts["bubble"] < parts["bubble"] / 3


def test_matmul_time_is_executed_flops_over_achievable_rate():
    from engine.plan.flops import model_flops_per_step
    shape = ModelShape(4, 256, 4, 1000, 128, 8)
    single = cluster(1)
    for rc in ("none", "selective", "full"):
        lay = Layout(1, 1, 1, micro_batch_size=2, recompute=rc)
        t1 = estimate(shape, replace(single, achievable_fraction=0.5), lay).step_time_s
        t2 = estimate(shape, replace(single, achievable_fraction=0.25), lay).step_time_s
        flops = model_flops_per_step(8, 128, 4, 256, 1000, recompute=rc)
        assert t2 - t1 == pytest.approx(flops / (312e12 * 0.25) - flops / (312e12 * 0.5), rel=1e-9)


def test_search_is_sorted_feasible_and_fast():
    import time
    shape = ModelShape(128, 25600, 160, 51200, 2048, 3072)
    c = cluster(3072)
    start = time.perf_counter()
    results = plan.search(shape, c)
    assert time.perf_counter() - start < 5.0
    assert results and all(r.fits for r in results)
    assert all(check_layout(shape, c, r.layout) is None for r in results)
    times = [r.step_time_s for r in results]
    assert times == sorted(times)
    limit = c.memory_gb * GIB
    assert all(r.memory_bytes_per_device < limit for r in results)


# ---- published rows (Narayanan et al. 2021, Table 1; layouts from examples/sc21/run_table_1.sh) --

PAPER = [  # shape, GPUs, (tp, pp, mbs), published TFLOP/s per GPU
    (ModelShape(24, 2304, 24, 51200, 2048, 512), 32, (1, 1, 16), 137.0),
    (ModelShape(48, 8192, 64, 51200, 2048, 1536), 512, (8, 2, 4), 138.0),
    (ModelShape(128, 25600, 160, 51200, 2048, 3072), 3072, (8, 64, 1), 163.0),
]
PAPER_SPACE = plan.SearchSpace(recompute=("full",), zero=(False,), sequence_parallel=(False,))


def paper_cluster(gpus):
    # DGX A100: 8 GPUs on NVSwitch (300 GB/s per direction), one 200 Gb/s HCA per GPU; fp16 grads
    return Cluster.from_device(A100, gpus, 8, 300.0, 25.0, grad_reduce_bytes=2)


@pytest.mark.parametrize("shape,gpus,published,tflops", PAPER)
def test_published_tflops_within_15_percent(shape, gpus, published, tflops):
    tp, pp, mbs = published
    space = replace(PAPER_SPACE, tp=tp, pp=pp, vp=1, micro_batch_size=mbs)
    (est,) = plan.search(shape, paper_cluster(gpus), space)
    assert est.layout.dp == gpus // (tp * pp)
    assert est.tflops_per_device == pytest.approx(tflops, rel=0.15)


@pytest.mark.parametrize("shape,gpus,published,tflops", PAPER)
def test_published_layout_ranks_in_top_three(shape, gpus, published, tflops):
    def top_pairs(space):
        pairs = []
        for est in plan.search(shape, paper_cluster(gpus), space):
            pair = (est.layout.tp, est.layout.pp)
            if pair not in pairs:
                pairs.append(pair)
        return pairs[:3]
    assert published[:2] in top_pairs(PAPER_SPACE)  # the paper's software: full recompute, no ZeRO/SP
    assert published[:2] in top_pairs(plan.SearchSpace())  # and with every option open


# ---- command line ------------------------------------------------------------------------------

ARGS = ["--num-layers", "48", "--hidden-size", "8192", "--num-attention-heads", "64",
        "--vocab-size", "51200", "--seq-length", "2048", "--global-batch-size", "1536",
        "--device", "a100-80gb", "--devices", "512"]


def run_cli(argv, capsys):
    assert plan.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_cli_json_keys_and_top(capsys):
    rows = run_cli(ARGS + ["--json", "--top", "3"], capsys)
    assert len(rows) == 3
    for row in rows:
        assert set(plan.JSON_KEYS) <= set(row)
    assert rows[0]["step_time_s"] <= rows[1]["step_time_s"] <= rows[2]["step_time_s"]


def test_cli_config_recipe_and_layout(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num-layers: 48\nhidden_size: 8192\nheads: 64\nvocab_size: 51200\n"
                      "seq_length: 2048\nglobal-batch-size: 1536\nlr: 1.0e-4\n")
    layout = ["--layout", "8,2", "--micro-batch-size", "4", "--recompute", "full", "--zero", "off",
              "--sequence-parallel", "off", "--json"]
    from_flags = run_cli(ARGS + layout, capsys)
    from_recipe = run_cli(["--config", str(recipe), "--devices", "512"] + layout, capsys)
    assert from_flags == from_recipe and len(from_flags) == 1
    assert (from_flags[0]["tp"], from_flags[0]["pp"], from_flags[0]["vp"]) == (8, 2, 1)


def test_cli_explains_rejected_layout(capsys):
    assert plan.main(ARGS + ["--layout", "4,4"]) == 1
    assert "PP across nodes" in capsys.readouterr().err
    assert plan.main(ARGS + ["--layout", "8,1", "--recompute", "none", "--zero", "off"]) == 1
    assert "GiB per device" in capsys.readouterr().err  # 39B weights alone need 88 GB at tp 8
    assert plan.main(ARGS[:-2] + ["--devices", "12"]) == 2
    assert "whole number of nodes" in capsys.readouterr().err


def test_calibration_recovers_the_fraction(tmp_path, capsys):
    shape, gpus, (tp, pp, mbs), _ = PAPER[1]
    c = paper_cluster(gpus)
    lay = Layout(tp, pp, gpus // (tp * pp), 1, mbs, "full")
    truth = estimate(shape, replace(c, achievable_fraction=0.55), lay).tflops_per_device
    assert plan.fit_achievable_fraction(shape, c, lay, truth) == pytest.approx(0.55, rel=1e-6)
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "tflops_per_device": 1.0, "skipped": False}] + [
        {"step": k, "tflops_per_device": truth * (1 + d), "skipped": False} for k, d in
        ((2, 0.0), (3, 0.01), (4, -0.01))] + [{"step": 5, "tflops_per_device": 5 * truth, "skipped": True}]
    metrics.write_text("\n".join(json.dumps(r) for r in lines))
    assert plan.measured_tflops(str(metrics)) == pytest.approx(truth)
    argv = ARGS + ["--layout", "8,2", "--micro-batch-size", "4", "--recompute", "full", "--zero", "off",
                   "--sequence-parallel", "off", "--grad-reduce-bytes", "2",
                   "--calibrate", str(metrics), "--json"]
    (row,) = run_cli(argv, capsys)
    assert row["tflops_per_device"] == pytest.approx(truth, rel=1e-4)


def test_link_calibration(tmp_path):
    pre = tmp_path / "preflight.json"
    pre.write_text(json.dumps([
        {"op": "all_reduce", "group": "tp", "bytes": 1 << 20, "busbw_gbps": 50.0},
        {"op": "all_reduce", "group": "tp", "bytes": 1 << 28, "busbw_gbps": 180.0},
        {"op": "all_reduce", "group": "dp", "bytes": 1 << 28, "busbw_gbps": 21.0},
        {"op": "all_gather", "group": "dp", "bytes": 1 << 28, "busbw_gbps": 23.0},
        {"op": "all_reduce", "group": "mystery", "bytes": 1 << 30, "busbw_gbps": 1.0},
    ]))
    assert plan.link_busbw(str(pre)) == {"intra": 180.0, "inter": 22.0}
    args = plan.build_parser().parse_args(ARGS + ["--calibrate-links", str(pre)])
    c = plan.cluster_from_args(args)
    assert (c.intra_busbw_gbps, c.inter_busbw_gbps) == (180.0, 22.0)
