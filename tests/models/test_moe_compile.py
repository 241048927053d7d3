"""The MoE block under torch.compile at ep 1: no graph break (torch._dynamo.explain counts them),
dropless and with a capacity (padded to it, and unpadded: the dropped copies sort last, so the
shapes stay static) in gpt2 blocks, dropless in llama blocks (also with the expert bias), with the
balancing losses; the compiled block (whole graph, ``fullgraph=True``) gives eager's output and
every gradient. Routing, counting, the grouped GEMMs over the stacked experts
(``gridtron::grouped_mm``, whose shape function serves fp32 too) and the combine all stay in the
graph: nothing is read on the host."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from models import LayerContext, build_chunks
from models.config import GPTConfig
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer

CASES = {"dropless": {}, "capacity": {"moe_expert_capacity_factor": 1.0},
         "padded": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
         # the biased choice, and the unbiased one the aux loss counts
         "bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}}


def _block(kind: str, fields: dict):
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=64, seed=3, block=kind, num_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3, **fields)
    chunk = build_chunks(cfg, ParallelState.serial(), LayerContext(Initializer(3, cfg.init_std)),
                         [range(1)], [0], 1)[0]
    return chunk.layers[0]


def _run(fn, block, x):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("kind,case", [("gpt2", "dropless"), ("gpt2", "capacity"),
                                       ("gpt2", "padded"), ("llama", "dropless"),
                                       ("llama", "bias")])
def test_moe_block_compiles_whole_and_matches_eager(kind, case):
    block = _block(kind, CASES[case])
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    dynamo.reset()
    explained = dynamo.explain(block)(x.clone().requires_grad_())
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    dynamo.reset()
    block.mlp.reset_totals()
    want = _run(block, block, x)
    got = _run(torch.compile(block, backend="aot_eager", fullgraph=True), block, x)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"item {i}: {m}")
    assert int(block.mlp.totals.forwards) == 2  # the eager and the compiled forward each counted once


def test_a_step_of_many_micro_batches_is_one_graph():
    """A whole MoE chunk compiled as engine/device/compile.py compiles it (its recompile limit),
    four micro-batches per step over two steps (set_aux_grad_scale between them, a new loss
    scale): one graph, and the step's figures (StepFigures.vector) equal eager's. The layer's
    figures used to be a list appended inside the graph, whose length Dynamo guarded (a graph per
    micro-batch, eager past the limit), and the balancing losses' gradient factor a number (a
    graph per loss scale)."""
    from torch._dynamo.utils import counters
    from engine.device.compile import chunk_recompile_limit
    from models.moe.stats import set_aux_grad_scale
    from models.moe.step_figures import StepFigures
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=64, seed=3, block="gpt2", num_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    vectors, grads = [], []
    for compiled in (False, True):
        chunks = build_chunks(cfg, ParallelState.serial(),
                              LayerContext(Initializer(3, cfg.init_std)), [range(1)], [0], 1)
        figures = StepFigures.of(chunks)
        if compiled:
            chunks[0].compile(backend="eager", recompile_limit=chunk_recompile_limit(1))
            dynamo.reset()
            counters.clear()
        g = torch.Generator().manual_seed(0)
        for scale in (0.25, 0.125):   # (fp16's loss scale backs off between the steps)
            set_aux_grad_scale(chunks, scale)
            for _ in range(4):
                tokens = torch.randint(0, 64, (2, 9), generator=g)
                chunks[0](tokens[:, :-1], tokens[:, 1:]).mean().backward()
            vectors.append(figures.vector(chunks, 4, True, torch.device("cpu")))
        grads.append(next(m for m in chunks[0].modules() if hasattr(m, "aux_grad_scale"))
                     .router.weight.grad.clone())   # the balancing losses' factor reached it
        if compiled:
            assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert vectors[0][3:].sum() == 4 * 2 * 8 * 2   # every token's two choices counted once
    for eager, comp in zip(vectors[:2], vectors[2:]):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    dynamo.reset()
