"""Mixture-of-experts layers on one process: layer pattern, router, the layer against a per-token
reference, the balancing losses, blocks (gpt2, llama, a user's) and the flags' bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.base import ConfigError
from engine.config.cli import parse_args
from models import LayerContext, ParallelMLP, build_chunks
from models.config import GPTConfig
from models.moe.balancing import aux_loss_share, seq_aux_loss_share
from models.moe.config import moe_layer_pattern
from models.moe.layer import MoELayer, build_mlp
from models.moe.router import TopKRouter, stable_topk
from models.moe.stats import load_imbalance, pop_moe_stats, set_aux_grad_scale
from models.registry import BlockRegistry
from parallel.runtime.comm import single_rank_group
from parallel.expert_parallel import count_per_expert
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from tests.helpers.moe_reference import expert_forward


def cfg_of(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
                num_experts=4, moe_router_topk=2)
    return GPTConfig(**{**base, **kw})


def ctx() -> LayerContext:
    return LayerContext(Initializer(7, 0.1))


def test_layer_pattern():
    assert moe_layer_pattern("1", 3) == [True] * 3
    assert moe_layer_pattern("2", 4) == [True, False, True, False]
    assert moe_layer_pattern("[0,1,1,1]", 4) == [False, True, True, True]
    assert moe_layer_pattern("([0]+[1]*3)", 4) == [False, True, True, True]
    for bad in ("[0,1]", "[0,2,1,1]", "0", "every", "__import__('os')"):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            moe_layer_pattern(bad, 4)
    assert not cfg_of(moe_layer_freq="[0,1]").is_moe_layer(0)
    assert cfg_of(moe_layer_freq="[0,1]").is_moe_layer(1) and not cfg_of(num_experts=None).is_moe_layer(0)


def test_router_score_functions_and_ties():
    values, index = stable_topk(torch.tensor([[1.0, 3.0, 3.0, 3.0]]), 2)
    assert index.tolist() == [[1, 2]] and values.tolist() == [[3.0, 3.0]]  # lower index wins
    x = torch.randn(5, 16)
    r = TopKRouter(16, 4, 2, Initializer(1, 0.5), "r")
    out = r(x)
    logits = x @ r.weight.t()
    top, idx = logits.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(out.experts, idx[:, :2])
    torch.testing.assert_close(out.weights, torch.softmax(top[:, :2], -1))  # Mixtral
    r.pre_softmax = True
    pre = r(x)
    torch.testing.assert_close(pre.weights, torch.softmax(logits, -1).gather(1, idx[:, :2]))
    assert (pre.weights.sum(-1) < 1).all()  # not renormalised
    r.pre_softmax, r.score_function = False, "sigmoid"
    sig = r(x)
    chosen = torch.sigmoid(logits).gather(1, idx[:, :2])
    torch.testing.assert_close(sig.weights, chosen / chosen.sum(-1, keepdim=True))
    assert r(x.double()).logits.dtype == torch.float32


@pytest.mark.parametrize("kind,bias", [("gelu", True), ("swiglu", False)])
def test_layer_equals_per_token_reference(kind, bias):
    cfg = cfg_of(moe_shared_expert_intermediate_size=8, moe_ffn_hidden_size=12)
    ps = ParallelState.serial()
    layer = MoELayer(cfg, ps, ctx(), "layers.0.mlp", kind=kind, bias=bias)
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = layer(x)
    tokens = x.reshape(-1, 16)
    routing = layer.router(tokens)
    ref = torch.stack([sum(routing.weights[t, j] * expert_forward(layer.experts, int(e), tokens[t:t + 1])[0]
                           for j, e in enumerate(routing.experts[t])) for t in range(16)])
    ref = ref.view(2, 8, 16) + layer.shared_expert(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert x.grad is not None and layer.router.weight.grad is not None
    assert all(p.grad is not None for p in layer.experts.parameters())
    assert all(getattr(p, "expert_parallel", False) for p in layer.experts.parameters())
    assert not any(getattr(p, "expert_parallel", False) for p in layer.router.parameters())


def test_balancing_losses_and_their_gradient_scale():
    scores = torch.softmax(torch.randn(12, 4), -1)
    experts = torch.tensor([[0, 1]] * 6 + [[2, 1]] * 6)
    share, counts = aux_loss_share(scores, count_per_expert(experts, 4), 2, 0.1,
                                   single_rank_group("dp"))
    f = torch.tensor([6.0, 12.0, 6.0, 0.0]) / 24
    torch.testing.assert_close(share, 0.1 * 4 * (f * scores.mean(0)).sum())
    assert counts.tolist() == [6.0, 12.0, 6.0, 0.0]
    per_seq = seq_aux_loss_share(scores, experts, 2, 0.1)  # sequences of 6 tokens
    fs = torch.tensor([[6.0, 6.0, 0.0, 0.0], [0.0, 6.0, 6.0, 0.0]]) / 12
    ps_ = scores.view(2, 6, 4).mean(1)
    torch.testing.assert_close(per_seq, 0.1 * 4 * (fs * ps_).sum(-1).mean())
    # the balancing loss trains the router; its weight is the step's aux_grad_scale
    cfg = cfg_of(moe_aux_loss_coeff=1.0, num_layers=1)
    grads = []
    for scale in (0.0, 1.0, 2.0):
        layer = MoELayer(cfg, ParallelState.serial(), ctx(), "layers.0.mlp")
        layer.set_aux_grad_scale(scale)
        layer(torch.ones(1, 4, 16) * torch.arange(16.0) / 16).sum().backward()
        grads.append(layer.router.weight.grad.clone())
    torch.testing.assert_close(grads[2] - grads[0], 2 * (grads[1] - grads[0]))
    assert not torch.allclose(grads[1], grads[0])
    assert load_imbalance(torch.tensor([2.0, 2.0])) == 1.0 and load_imbalance(torch.tensor([3.0, 1.0])) == 1.5


class UserBlock(nn.Module):
    """A user's block built from the engine's pieces: its MLP from build_mlp."""
    position, final_norm, tie_embeddings = "learned", "layernorm", True

    def __init__(self, cfg, layer_idx, ps, ctx):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = build_mlp(cfg, layer_idx, ps, ctx, f"layers.{layer_idx}.mlp")

    def forward(self, x):
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize("block", ["gpt2", "llama", "user"])
def test_blocks_train_with_moe(block):
    registry = BlockRegistry()
    registry.register("user", UserBlock)
    cfg = cfg_of(block=block, moe_layer_freq="[1,0]", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    chunks = build_chunks(cfg, ParallelState.serial(), ctx(), [range(2)], [0], 1, registry=registry)
    layers = chunks[0].layers
    assert isinstance(layers[0].mlp, MoELayer) and isinstance(layers[1].mlp, ParallelMLP)
    set_aux_grad_scale(chunks, 0.5)
    assert layers[0].mlp.aux_grad_scale == 0.5
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = chunks[0](tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    stats = pop_moe_stats(chunks, 1)
    assert stats["aux_loss"] > 0 and stats["z_loss"] > 0 and stats["load"].sum() == 2 * 8 * 2
    assert pop_moe_stats(chunks, 1)["load"] is None  # records emptied
    assert torch.isfinite(loss) and loss > 0


def test_sequence_parallel_marks_router_and_experts():
    """Under sequence parallelism the replicas over TP saw distinct tokens: their gradients are
    summed over TP like the norms' (tests/equivalence/test_equivalence_moe_layouts.py)."""
    ps = ParallelState(RankGrid(tp=2), rank=0)
    for sp in (True, False):
        layer = MoELayer(cfg_of(), ps, LayerContext(Initializer(), sequence_parallel=sp), "m")
        params = [*layer.router.parameters(), *layer.experts.parameters()]
        assert layer.tp_split is sp and params
        assert all(getattr(p, "sequence_parallel", False) is sp for p in params)


@pytest.mark.parametrize("argv,message", [
    (["--num-experts", "6", "--ep", "4", "--dp", "4"], "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (["--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff configures mixture-of-experts layers, which need --num-experts"),
    (["--moe-router-topk", "4", "--moe-layer-freq", "2"], "--moe-layer-freq, --moe-router-topk configure"),
    (["--ep", "2"], "--expert-model-parallel-size 2 splits mixture-of-experts layers"),
    (["--num-experts", "4", "--etp", "2"], "--expert-tensor-parallel-size 2: only 1"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,1]", "--num-layers", "4"], "the list needs 4 entries"),
    (["--num-experts", "4", "--moe-router-score-function", "relu"], "--moe-router-score-function"),
])
def test_bad_flags_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ep_must_divide_dp_cp_before_any_group():
    cfg = parse_args(["--num-experts", "4", "--ep", "2"])
    assert cfg.model.moe_ffn_hidden_size == cfg.model.ffn_hidden_size
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 must divide dp x cp = 3 x 1 = 3"):
        cfg.parallel.grid(3)
    assert cfg.parallel.grid(4).dp == 4
