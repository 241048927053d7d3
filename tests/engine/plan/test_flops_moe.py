"""Model FLOPs of MoE models count the active experts, executed FLOPs the padded expert rows too:
the formula (engine/plan/flops.py) against torch.utils.flop_counter on the engine's own MoE model
(fp32, CPU), forward and backward."""
from __future__ import annotations

import pytest

from engine.plan.flops import MoEShape, count_flops, moe_shape, routed_tokens, step_flops


def _counted(block: str, recompute: str, monkeypatch, **moe):
    import torch

    import kernels
    from models import GPTChunk, GPTConfig, LayerContext
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    monkeypatch.setattr(kernels, "attention", lambda q, k, v, causal=True, dropout_p=0.0,
                        document_ids=None, cu_seqlens=None, **npu_only:
                        kernels.attention_reference(q, k, v, causal, dropout_p, document_ids=document_ids))
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=128, block=block, num_experts=4, moe_router_topk=2, **moe)
    ctx = LayerContext(Initializer(1, 0.02), sequence_parallel=False, recompute=recompute)
    model = GPTChunk(cfg, ParallelState.serial(), ctx, range(2)).train()
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 128, (2, 3, 16), generator=gen)
    _, flops = count_flops(lambda: model(tokens, labels).mean().backward())
    return flops, cfg


@pytest.mark.parametrize("block,recompute,moe", [
    ("gpt2", "none", dict(moe_shared_expert_intermediate_size=24, moe_aux_loss_coeff=0.01,
                          moe_z_loss_coeff=1e-3)),
    ("llama", "none", dict(moe_layer_freq="[0,1]", moe_ffn_hidden_size=40)),
    ("gpt2", "full", dict(moe_shared_expert_intermediate_size=24, moe_expert_capacity_factor=4.0)),
    ("llama", "full", dict(moe_ffn_hidden_size=40)),
    # padded to the capacity: 4 x 48 rows per forward of 48 tokens, 96 of them padding
    ("gpt2", "none", dict(moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True)),
    # a capacity that drops: the padded layout runs 4 x 12 rows, 48 fewer than the 96 assignments
    ("llama", "full", dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)),
])
def test_moe_flops_match_the_counter_on_the_engine_model(block, recompute, moe, monkeypatch):
    counted, cfg = _counted(block, recompute, monkeypatch, **moe)
    # one forward of the 3 x 16 tokens: the capacity's T
    f = step_flops(3, 16, 2, 32, 128, cfg.ffn_hidden_size, block, recompute, moe=moe_shape(cfg),
                   routed_tokens=48)
    assert counted == f.executed
    dense = step_flops(3, 16, 2, 32, 128, cfg.ffn_hidden_size, block, recompute)
    assert f.model != dense.model


def test_active_experts_by_hand():
    # one layer, h 8, E 4, K 2, f_e 16, shared 8, gpt2 (2 matrices), 10 tokens: the MLP's forward
    # is router 2*10*8*4 + experts 2*10*2*(2*16*8) + shared 2*10*2*8*8 = 640 + 10240 + 2560
    shape = MoEShape(layers=1, num_experts=4, topk=2, ffn_hidden=16, shared_ffn=8)
    dense = step_flops(1, 10, 1, 8, 4, ffn_hidden=32)
    moe = step_flops(1, 10, 1, 8, 4, ffn_hidden=32, moe=shape)
    assert moe.model - dense.model == 3 * (640 + 10240 + 2560 - 2 * 10 * 2 * 8 * 32)
    assert moe_shape(type("C", (), {"num_experts": None})()) is None
    with pytest.raises(ValueError, match="MoE layers in a model of 1 layers"):
        step_flops(1, 10, 1, 8, 4, moe=MoEShape(2, 4, 2, 16))
    with pytest.raises(ValueError, match="MoEShape needs positive"):
        MoEShape(1, 4, 0, 16)


def test_padded_rows_count_in_executed_flops_only():
    # 10 tokens in 2 forwards of 5, E 4, K 2, F 2: C = ceil(2 5 2 / 4) = 5, so 4 x 5 - 5 x 2 = 10
    # padding rows per forward, each 2 x 2 x 8 x 16 FLOPs forward (gpt2, h 8, f_e 16), 3 passes
    padded = MoEShape(layers=1, num_experts=4, topk=2, ffn_hidden=16, padded_capacity_factor=2.0)
    plain = step_flops(1, 10, 1, 8, 4, ffn_hidden=32, moe=MoEShape(1, 4, 2, 16))
    f = step_flops(1, 10, 1, 8, 4, ffn_hidden=32, moe=padded, routed_tokens=5)
    assert f.model == plain.model
    assert f.executed - f.model == f.padded == 3 * (2 * 10) * (2 * 2 * 8 * 16)
    assert f.recomputed == 0
    with pytest.raises(ValueError, match="routed_tokens"):
        step_flops(1, 10, 1, 8, 4, ffn_hidden=32, moe=padded)
    # T: the micro-batch's tokens over CP, a TP rank's shard under SP without ETP
    assert routed_tokens(2, 16, cp=2) == 16 and routed_tokens(2, 16, tp=2) == 32
    assert routed_tokens(2, 16, tp=2, sequence_parallel=True) == 16
    assert routed_tokens(2, 16, tp=2, sequence_parallel=True, etp=2) == 32
