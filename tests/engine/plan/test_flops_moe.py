"""Model FLOPs of MoE models count the active experts: the formula (engine/plan/flops.py) against
torch.utils.flop_counter on the engine's own MoE model (fp32, CPU), forward and backward."""
from __future__ import annotations

import pytest

from engine.plan.flops import MoEShape, count_flops, moe_shape, step_flops


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
])
def test_moe_flops_match_the_counter_on_the_engine_model(block, recompute, moe, monkeypatch):
    counted, cfg = _counted(block, recompute, monkeypatch, **moe)
    f = step_flops(3, 16, 2, 32, 128, cfg.ffn_hidden_size, block, recompute, moe=moe_shape(cfg))
    assert counted == (f.model if recompute == "none" else f.executed)
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
