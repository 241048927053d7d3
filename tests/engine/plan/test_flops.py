"""FLOPs formulas (model and executed counts) against torch.utils.flop_counter on the engine's own
model (gpt2 and llama, MLP widths, grouped-query attention, every recomputation, with and without
early stop) and against Megatron's published closed forms; the no-formula signal, utilisation
helpers and the device table with its per-precision peaks."""
import dataclasses

import pytest

from engine.plan.flops import (achieved_tflops, count_flops, default_ffn_hidden,
                               formula_block, layer_matmul_params, megatron_flops_per_step, mfu,
                               model_flops_per_step, step_flops, utilization)
from engine.plan.hardware import (DEVICE_SPECS, DeviceSpec, get_device_spec, lookup_device,
                                  lookup_peak_tflops, peak_tflops)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("b,s,l,h,v", [(512, 2048, 24, 2304, 51200), (3, 128, 5, 96, 1000),
                                       (3072, 2048, 128, 25600, 51200)])
def test_reduces_to_megatron_closed_form(b, s, l, h, v, recompute):
    ours = step_flops(b, s, l, h, v, ffn_hidden=4 * h, recompute=recompute, recompute_early_stop=False)
    assert ours.executed == pytest.approx(megatron_flops_per_step(b, s, l, h, v, recompute), rel=1e-12)
    assert ours.model == pytest.approx(megatron_flops_per_step(b, s, l, h, v), rel=1e-12)


BATCH, SEQ, LAYERS, HIDDEN, VOCAB = 3, 32, 2, 64, 256   # 256: no vocabulary padding at tp 1


def counted_step_flops(monkeypatch, block: str = "gpt2", recompute: str = "none",
                       early_stop: bool = True, ffn: int | None = None, groups: int | None = None,
                       dropout: float = 0.0):
    """torch.utils.flop_counter's count of one forward + backward of the engine's own GPT chunk
    over BATCH sequences, with the attention core on the plain-math reference (the counter sees
    its two matmuls; it has no formula for the CPU flash kernel's backward); the chunk's config."""
    import torch
    from torch.utils.checkpoint import set_checkpoint_early_stop

    import kernels
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, causal=True, dropout_p=0.0,
                        document_ids=None, cu_seqlens=None, **npu_only:
                        kernels.attention_reference(q, k, v, causal, dropout_p, document_ids=document_ids))
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                    vocab_size=VOCAB, block=block, ffn_hidden_size=ffn, num_query_groups=groups,
                    dropout=dropout)
    ctx = LayerContext(Initializer(1, 0.02), sequence_parallel=False, recompute=recompute)
    model = GPTChunk(cfg, ParallelState.serial(), ctx, range(LAYERS)).train()
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=gen)
    with set_checkpoint_early_stop(early_stop):
        _, flops = count_flops(lambda: model(tokens, labels).mean().backward())
    return flops, cfg


# (block, recompute, early stop, ffn width, key/value groups). Selective recomputation reruns the
# whole attention core (SDPA is one op); the plain-math reference is two matmuls, of which early
# stop would skip the second, so its count turns early stop off (the formula has no early stop
# for selective).
CASES = [("gpt2", "none", True, None, None), ("gpt2", "full", True, None, None),
         ("gpt2", "full", False, None, None), ("gpt2", "selective", False, None, None),
         ("llama", "none", True, None, None), ("llama", "full", True, None, None),
         ("gpt2", "none", True, 96, None), ("llama", "full", True, 96, None),
         ("gpt2", "none", True, None, 2), ("llama", "full", True, None, 1),
         ("llama", "selective", False, None, 2)]


@pytest.mark.parametrize("block, recompute, early_stop, ffn, groups", CASES)
def test_step_flops_are_what_the_engine_model_runs(monkeypatch, block, recompute, early_stop, ffn,
                                                   groups):
    """The model count is the counter's on a step without recomputation, the executed count on
    the step with it: any block, MLP width, grouped-query attention and recomputation."""
    model, cfg = counted_step_flops(monkeypatch, block, "none", True, ffn, groups)
    executed, _ = counted_step_flops(monkeypatch, block, recompute, early_stop, ffn, groups)
    want = step_flops(BATCH, SEQ, LAYERS, HIDDEN, VOCAB, cfg.ffn_hidden_size, block, recompute,
                      recompute_early_stop=early_stop, kv_hidden=cfg.kv_hidden_size)
    assert (want.model, want.executed) == (model, executed)
    assert recompute == "none" or executed > model


@pytest.mark.parametrize("block, groups, recompute", [("gpt2", None, "none"), ("gpt2", None, "full"),
                                                      ("llama", 2, "full"), ("llama", 1, "none")])
def test_estimate_flops_are_what_the_engine_model_runs(monkeypatch, block, groups, recompute):
    """The FLOPs the planner prices (MFU's and HFU's numerators) are torch.utils.flop_counter's
    count of a forward and backward of the engine's model of that shape: without recomputation
    (model) and with it (executed), grouped-query attention's narrower K/V included."""
    from engine.plan.model import Cluster, Layout, ModelShape
    from engine.plan.timing import estimate
    model, _ = counted_step_flops(monkeypatch, block, "none", groups=groups)
    executed, _ = counted_step_flops(monkeypatch, block, recompute, groups=groups)
    shape = ModelShape(LAYERS, HIDDEN, 4, VOCAB, SEQ, BATCH, block=block, num_query_groups=groups)
    cluster = Cluster.from_device(DEVICE_SPECS["a100-80gb"], 8)
    est = estimate(shape, cluster, Layout(1, 1, 1, micro_batch_size=BATCH, recompute=recompute))
    assert (est.flops.model, est.flops.executed) == (model, executed)


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_full_recompute_with_dropout_reruns_the_whole_forward(monkeypatch, block):
    """With --dropout > 0 the block's last dropout keeps its mask, so checkpoint's early stop reruns
    the down projection: the step runs every layer's whole forward again (counted by hand from the
    counter's step without recomputation), and the planner's CLI, the trainer's planner_inputs and
    step_flops with recompute_stops_early (what engine/observe/utilization.py passes) say so."""
    from engine.config.cli import parse_args
    from engine.plan.flops import recompute_stops_early
    from engine.plan.model import Cluster, Layout
    from engine.plan.timing import estimate
    from engine.tools.plan_cli import build_parser, shape_from_args
    from engine.training.memory_check import planner_inputs
    model, cfg = counted_step_flops(monkeypatch, block, "none", dropout=0.1)
    executed, _ = counted_step_flops(monkeypatch, block, "full", True, dropout=0.1)
    h, f, n = HIDDEN, cfg.ffn_hidden_size, {"gpt2": 2, "llama": 3}[block]
    forward = BATCH * SEQ * (2 * (4 * h * h + n * h * f) + 4 * SEQ * h)   # one layer, by hand
    assert executed == model + LAYERS * forward
    flags = ["--num-layers", str(LAYERS), "--hidden-size", str(h), "--num-attention-heads", "4",
             "--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--block", block,
             "--global-batch-size", str(BATCH), "--dropout", "0.1"]
    run = parse_args(flags + ["--micro-batch-size", str(BATCH), "--recompute", "full", "--mock-data"])
    shapes = [shape_from_args(build_parser().parse_args(flags + ["--devices", "1"])),
              planner_inputs(run, run.parallel.grid(1))[0]]
    cluster = Cluster.from_device(DEVICE_SPECS["a100-80gb"], 1)
    for shape in shapes:
        est = estimate(shape, cluster, Layout(1, 1, 1, micro_batch_size=BATCH, recompute="full"))
        assert (est.flops.model, est.flops.executed) == (model, executed)
    trainer = step_flops(BATCH, SEQ, LAYERS, h, VOCAB, f, block, "full",
                         recompute_early_stop=recompute_stops_early(cfg.dropout))
    assert trainer.executed == executed


def test_formula_block_says_when_there_is_no_formula():
    from models.blocks import GPT2Block, LlamaBlock, TransformerBlock

    class MyBlock(GPT2Block):
        def forward(self, x):
            return x

    assert (formula_block("gpt2"), formula_block("llama")) == ("gpt2", "llama")
    assert (formula_block(GPT2Block), formula_block(LlamaBlock)) == ("gpt2", "llama")
    assert formula_block(MyBlock) is None and formula_block(TransformerBlock) is None
    assert formula_block("mypkg.blocks:MoE") is None
    with pytest.raises(ValueError, match="no FLOPs formula"):
        step_flops(1, 1, 1, 1, 1, block="mypkg.blocks:MoE")


def test_default_ffn_matches_model_config():
    from models.config import GPTConfig
    for h, heads in ((128, 4), (4096, 32), (768, 12)):
        for block in ("gpt2", "llama"):
            cfg = GPTConfig(hidden_size=h, num_attention_heads=heads, block=block)
            assert default_ffn_hidden(h, block) == cfg.ffn_hidden_size
            assert model_flops_per_step(1, 8, 1, h, 16, block=block) == \
                model_flops_per_step(1, 8, 1, h, 16, ffn_hidden=cfg.ffn_hidden_size, block=block)


def test_formula_matrices_are_the_models():
    """A layer's weight matrices, as the formulas count them, are the built layer's."""
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    for block, groups in (("llama", 1), ("llama", 2), ("gpt2", 2), ("gpt2", 4)):
        cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                        seq_length=8, vocab_size=64, block=block)
        chunk = GPTChunk(cfg, ParallelState.serial("cpu"), LayerContext(Initializer(0, 0.02)), range(1))
        matrices = sum(p.numel() for p in chunk.layers[0].parameters() if p.ndim == 2)
        assert matrices == layer_matmul_params(32, cfg.ffn_hidden_size, block, cfg.kv_hidden_size)


def test_bad_arguments():
    with pytest.raises(ValueError, match="recompute"):
        model_flops_per_step(1, 1, 1, 1, 1, recompute="some")
    with pytest.raises(ValueError, match="block"):
        model_flops_per_step(1, 1, 1, 1, 1, block="bert")
    with pytest.raises(ValueError):
        achieved_tflops(1e12, 0.0, 8)


def test_achieved_and_utilization():
    assert achieved_tflops(8e15, 2.0, 16) == pytest.approx(250.0)
    assert utilization(156.0, 312.0) == pytest.approx(0.5) and mfu is utilization
    assert utilization(156.0, None) is None


@pytest.mark.parametrize("device,fp32,tf32,half", [
    ("NVIDIA A100-SXM4-80GB", 19.5, 156.0, 312.0), ("a100-40gb", 19.5, 156.0, 312.0),
    ("NVIDIA H100 80GB HBM3", 67.0, 494.7, 989.0), ("NVIDIA H200", 67.0, 494.7, 989.0),
    ("NVIDIA H100 PCIe", 51.0, 378.0, 756.0),
    ("Ascend910B2", None, None, 353.9), ("Ascend910A", None, None, 256.0), ("cpu", None, None, None),
])
def test_peaks_per_precision(device, fp32, tf32, half):
    assert peak_tflops(device, "fp32") == fp32
    assert peak_tflops(device, "fp32", tf32=True) == tf32
    assert peak_tflops(device, "bf16") == peak_tflops(device, "fp16") == lookup_peak_tflops(device)
    assert peak_tflops(device, "bf16") == pytest.approx(half) if half else peak_tflops(device, "bf16") is None
    assert peak_tflops(device, "bf16", tf32=True) == peak_tflops(device, "bf16")  # tf32: fp32 only


def test_peak_lookup_rejects_unknowns():
    assert peak_tflops("Tesla V100", "bf16") is None
    with pytest.raises(ValueError, match="precision"):
        peak_tflops("h100", "int4")
    # FP8: the dense peak where the chip has one (H100/H200 SXM: 1979 TFLOP/s), none on an A100
    assert peak_tflops("h100", "fp8") == peak_tflops("h200", "fp8") == 1979.0
    assert peak_tflops("a100-80gb", "fp8") is None


@pytest.mark.parametrize("raw,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H800", "h100"), ("Ascend910B2", "ascend910b2"),
    ("Ascend910B2C", "ascend910b2"), ("Ascend910B3", "ascend910b3"), ("Ascend910B4-1", "ascend910b4"),
    ("Ascend910B1", "ascend910b1"), ("Ascend910A", "ascend910"), ("Ascend910ProA", "ascend910"),
    ("h100", "h100"), ("cpu", "cpu"), ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200 NVL", "h200-nvl"),
])
def test_device_name_lookup(raw, key):
    assert lookup_device(raw) == key
    assert lookup_peak_tflops(raw) == DEVICE_SPECS[key].peak_tflops


@pytest.mark.parametrize("raw", ["NVIDIA H20", "Ascend910ProB", "Ascend910_9392", "Tesla V100", ""])
def test_unknown_devices_have_no_peak(raw):
    assert lookup_peak_tflops(raw) is None
    with pytest.raises(KeyError, match="known"):
        get_device_spec(raw or "nothing")


def test_table_values():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert lookup_peak_tflops("NVIDIA H200") == 989.0
    assert DEVICE_SPECS["h200"].memory_gb == 141.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert lookup_peak_tflops("Ascend910A") == 256.0
    assert DEVICE_SPECS["ascend910"].memory_gb == 32.0
    assert lookup_peak_tflops("cpu") is None
    # 910B cube peaks: cores * MHz * 16^3 * 2 (CANN platform_config)
    assert lookup_peak_tflops("Ascend910B1") == pytest.approx(24 * 1850e6 * 8192 / 1e12, abs=0.05)
    assert lookup_peak_tflops("Ascend910B2") == pytest.approx(353.9, abs=0.05)
    assert lookup_peak_tflops("Ascend910B3") == pytest.approx(294.9, abs=0.05)
    assert lookup_peak_tflops("Ascend910B4") == pytest.approx(245.8, abs=0.05)
    assert DEVICE_SPECS["ascend910b4"].memory_gb == 32.0


def test_table_is_immutable_and_specs_validated():
    with pytest.raises(TypeError):
        DEVICE_SPECS["mine"] = DEVICE_SPECS["h100"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEVICE_SPECS["h100"].peak_tflops = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="peak_tflops"):
        DeviceSpec("x", -1.0, 8.0, 10.0, 1.0, 8)
    custom = dataclasses.replace(DEVICE_SPECS["ascend910b"], peak_tflops=313.0)  # a settable SKU
    assert custom.peak_tflops == 313.0 and DEVICE_SPECS["ascend910b"].peak_tflops != 313.0
