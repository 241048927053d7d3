"""FLOPs formulas, MFU helpers and the device table."""
import dataclasses

import pytest

from engine.plan.flops import (achieved_tflops, default_ffn_hidden, layer_matmul_params,
                               megatron_flops_per_step, mfu, model_flops_per_step)
from engine.plan.hardware import DEVICE_SPECS, DeviceSpec, get_device_spec, lookup_device, lookup_peak_tflops


def test_unit_model_by_hand():
    # B = s = l = h = V = 1, f = 4: per token forward 8 + 16 + 4 (layer) + 2 (logits) = 30
    assert model_flops_per_step(1, 1, 1, 1, 1) == 90.0  # 72 (1 + 1/6 + 1/12)
    assert model_flops_per_step(1, 1, 1, 1, 1, recompute="full") == 118.0  # 96 (1 + 1/6 + 1/16)
    assert model_flops_per_step(1, 1, 1, 1, 1, recompute="selective") == 94.0  # + 4 B s^2 l h
    # llama, f = 3: 3 matrices of h x f -> 8 + 18 + 4 + 2 = 32 per token forward
    assert model_flops_per_step(1, 1, 1, 1, 1, ffn_hidden=3, block="llama") == 96.0


def test_small_case_exact():
    # B=2, s=4, l=3, h=8, V=10: layer fwd per token 24*64 + 4*4*8 = 1664, logits 160
    tokens = 2 * 4
    assert model_flops_per_step(2, 4, 3, 8, 10) == 3 * tokens * (3 * 1664 + 160)
    assert model_flops_per_step(2, 4, 3, 8, 10, recompute="full") == 4 * tokens * 3 * 1664 + 3 * tokens * 160


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("b,s,l,h,v", [(512, 2048, 24, 2304, 51200), (3, 128, 5, 96, 1000),
                                       (3072, 2048, 128, 25600, 51200)])
def test_reduces_to_megatron_closed_form(b, s, l, h, v, recompute):
    ours = model_flops_per_step(b, s, l, h, v, ffn_hidden=4 * h, recompute=recompute)
    assert ours == pytest.approx(megatron_flops_per_step(b, s, l, h, v, recompute), rel=1e-12)


def test_selective_adds_attention_core_forward():
    b, s, l, h, v = 4, 256, 6, 64, 500
    extra = model_flops_per_step(b, s, l, h, v, recompute="selective") - model_flops_per_step(b, s, l, h, v)
    assert extra == 4 * b * s * s * l * h


def test_mlp_generalises_with_ffn():
    b, s, l, h, v, f = 2, 16, 2, 32, 100, 80
    gpt2 = model_flops_per_step(b, s, l, h, v, ffn_hidden=f)
    llama = model_flops_per_step(b, s, l, h, v, ffn_hidden=f, block="llama")
    assert llama - gpt2 == 3 * b * s * l * 2 * h * f  # one more h x f matrix, fwd + bwd


def test_default_ffn_matches_model_config():
    from models.config import GPTConfig
    for h, heads in ((128, 4), (4096, 32), (768, 12)):
        for block in ("gpt2", "llama"):
            cfg = GPTConfig(hidden_size=h, num_attention_heads=heads, block=block)
            assert default_ffn_hidden(h, block) == cfg.ffn_hidden_size
            assert model_flops_per_step(1, 8, 1, h, 16, block=block) == \
                model_flops_per_step(1, 8, 1, h, 16, ffn_hidden=cfg.ffn_hidden_size, block=block)


def test_grouped_query_attention_counts_smaller_key_value_projections():
    # B=2, s=4, l=3, h=8, V=10 with 4 heads of d=2 in G=1 group: K and V are h x 2, so per token the
    # layer does 2 (2*64 + 2*8*2 + 2*8*32) + 4*4*8 = 1472 forward FLOPs instead of 1664
    tokens = 2 * 4
    assert model_flops_per_step(2, 4, 3, 8, 10, kv_hidden=2) == 3 * tokens * (3 * 1472 + 160)
    assert model_flops_per_step(2, 4, 3, 8, 10, kv_hidden=8) == model_flops_per_step(2, 4, 3, 8, 10)
    # the formula's matrices are the model's: one layer's weight matrices hold exactly that many
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.state import ParallelState
    from parallel.tensor_parallel import Initializer
    for block, groups in (("llama", 1), ("llama", 2), ("gpt2", 2), ("gpt2", 4)):
        cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                        seq_length=8, vocab_size=64, block=block)
        chunk = GPTChunk(cfg, ParallelState.serial("cpu"), LayerContext(Initializer(0, 0.02)), range(1))
        matrices = sum(p.numel() for p in chunk.layers[0].parameters() if p.ndim == 2)
        assert matrices == layer_matmul_params(32, cfg.ffn_hidden_size, block, cfg.kv_hidden_size)
        full = model_flops_per_step(1, 8, 1, 32, 64, ffn_hidden=cfg.ffn_hidden_size, block=block)
        gqa = model_flops_per_step(1, 8, 1, 32, 64, ffn_hidden=cfg.ffn_hidden_size, block=block,
                                   kv_hidden=cfg.kv_hidden_size)
        assert full - gqa == 3 * 8 * 2 * 2 * 32 * (32 - cfg.kv_hidden_size)  # 2 matrices, fwd+bwd


def test_bad_arguments():
    with pytest.raises(ValueError, match="recompute"):
        model_flops_per_step(1, 1, 1, 1, 1, recompute="some")
    with pytest.raises(ValueError, match="block"):
        model_flops_per_step(1, 1, 1, 1, 1, block="bert")
    with pytest.raises(ValueError):
        achieved_tflops(1e12, 0.0, 8)


def test_achieved_and_mfu():
    assert achieved_tflops(8e15, 2.0, 16) == pytest.approx(250.0)
    assert mfu(156.0, 312.0) == pytest.approx(0.5)
    assert mfu(156.0, None) is None


@pytest.mark.parametrize("raw,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA GH200 480GB", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H800", "h100"), ("Ascend910B2", "ascend910b2"),
    ("Ascend910B2C", "ascend910b2"), ("Ascend910B3", "ascend910b3"), ("Ascend910B4-1", "ascend910b4"),
    ("Ascend910B1", "ascend910b1"), ("Ascend910A", "ascend910"), ("Ascend910ProA", "ascend910"),
    ("h100", "h100"), ("cpu", "cpu"),
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
