"""The planner's attention activations of a RoPE block (llama) against the tensors the engine's
attention saves (saved-tensor hooks on the CPU, counted by hand): RoPE's new q and k are kept beside
the whole QKV projection output, which v, a view of it, keeps alive."""
from __future__ import annotations

import pytest

B, S, H, HEADS = 3, 40, 64, 4


def saved_activation_bytes(rope: bool, groups: int) -> int:
    """Bytes of the distinct activation storages a bf16 ParallelAttention forward saves for
    backward (weights, buffers and the RoPE tables left out; the kernel's fp32 log-sum-exp too)."""
    import torch

    from models import GPTConfig, LayerContext
    from models.layers import ParallelAttention
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    cfg = GPTConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, num_query_groups=groups,
                    seq_length=S, vocab_size=128, block="llama")
    attn = ParallelAttention(cfg, ParallelState.serial(), LayerContext(Initializer(1, 0.02)), "a",
                             bias=False, rope=rope).to(torch.bfloat16)
    owned = {t.untyped_storage().data_ptr() for t in [*attn.parameters(), *attn.buffers()]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        per_token = B in t.shape or B * S in t.shape
        if st.data_ptr() not in owned and per_token and t.dtype == torch.bfloat16:
            seen[st.data_ptr()] = st.nbytes()
        return t
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x)
    return sum(seen.values())


@pytest.mark.parametrize("groups", [HEADS, 2, 1])
def test_rope_attention_keeps_q_and_k_beside_the_qkv_output(monkeypatch, groups):
    """By hand, per token (bf16): the QKV input h, the whole QKV output h + 2 kv (v is a view of
    it), RoPE's new q (h) and k (kv) and the projection input h. The planner's llama layer counts
    h + kv more than Korthikanti's Q, K, V (h + 2 kv): the RoPE copies beside the whole output."""
    from engine.plan import memory
    from engine.plan.model import Layout, ModelShape
    kv = groups * H // HEADS
    assert saved_activation_bytes(True, groups) == 2 * B * S * (H + (H + 2 * kv) + H + kv + H)
    shape = ModelShape(1, H, HEADS, 128, S, B, block="llama", dropout=False,
                       num_query_groups=groups)
    layout = Layout(1, 1, 1, micro_batch_size=B, recompute="selective")
    planned = memory.layer_activation_bytes(shape, layout)
    monkeypatch.setattr(memory, "ROPE_BLOCKS", ())
    assert planned - memory.layer_activation_bytes(shape, layout) == 2 * B * S * (H + kv)
