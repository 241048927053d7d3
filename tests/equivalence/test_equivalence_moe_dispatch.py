"""The allgather token dispatcher against the alltoall one and the serial model (fp32, one seed).

- The patterns by hand on 2 ranks: ``_AllGatherForwardReduceScatterBackward`` and
  ``_ReduceScatterForwardAllGatherBackward`` forward and backward on rank-dependent tensors, and
  ``allgather_dispatch`` / ``allgather_combine`` on a hand-written routing: the rows each rank's
  experts get, the combined output and the gradients of the tokens and router weights against
  hand computations, and the collectives issued (all on the "ep" group).
- One MoE layer, one forward and backward, ep 2 over dp 2 (gelu experts with biases, swiglu
  experts without; dropless, capacity unpadded and padded) and ep 4 over dp 4 (gelu dropless,
  swiglu padded): the output, the input gradient and every parameter gradient of the allgather
  layer equal the alltoall layer's in the same layout, and, once reduced (experts over EDP, the
  router over DP), the serial layer's run on the same micro-batches.
- Training through the model, reducer, gradient clipping and SGD: ep 2 over dp 2 (gpt2 blocks,
  global aux loss, z-loss, shared expert) and ep 4 over dp 4 (llama, sigmoid scores, per-sequence
  aux loss, 1 micro-batch per rank against 2 serially, with --moe-grouped-gemm): per-step token
  loss, balancing loss and gradient norm equal the serial run's to a relative 1e-4.
- The flag: the command line takes alltoall and allgather and refuses anything else in one line.
"""
from __future__ import annotations

import pytest
import torch

from models import LayerContext
from models.config import GPTConfig
from models.moe.layer import MoELayer
from parallel.expert_parallel import (allgather_combine, allgather_dispatch, init_expert_groups,
                                      permute_tokens)
from parallel.expert_parallel.allgather import (_AllGatherForwardReduceScatterBackward,
                                                _ReduceScatterForwardAllGatherBackward)
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from tests.equivalence.test_equivalence_moe import GPT2, LLAMA, train  # the harness
from tests.helpers.dist_utils import record_comm, run_distributed
from tests.helpers.moe_reference import logical_grads

SEED, REL = 1234, 1e-4

# ---- the patterns by hand (2 ranks) -------------------------------------------------------------

E, K, T = 4, 2, 3
# rank -> (T, K) experts; rank 0 holds experts 0, 1 and rank 1 experts 2, 3
ROUTES = {0: [[0, 2], [1, 0], [3, 1]], 1: [[2, 3], [0, 2], [1, 3]]}
SCALE = [1.0, 2.0, 3.0, 4.0]  # expert e multiplies its rows by SCALE[e]


def _patterns(ps):
    init_expert_groups(ps, 2)
    group, r = ps.ep_group, ps.ep_group.rank
    # all-gather forward, reduce-scatter backward
    x = torch.tensor([[r + 1.0, 2.0 * (r + 1)]], requires_grad=True)         # (1, 2)
    y = _AllGatherForwardReduceScatterBackward.apply(x, group)
    assert torch.equal(y, torch.tensor([[1.0, 2.0], [2.0, 4.0]]))
    y.backward(torch.full((2, 2), r + 1.0) * torch.tensor([[1.0], [10.0]]))
    # my row's gradient, summed over both ranks: rank 0 row 0 gets 1 + 2, rank 1 row 1 gets 10 + 20
    assert torch.equal(x.grad, torch.full((1, 2), 3.0 if r == 0 else 30.0))
    # reduce-scatter forward, all-gather backward
    z = ((r + 1.0) * torch.tensor([[1.0, 1.0], [10.0, 10.0]])).requires_grad_()  # (2, 2)
    w = _ReduceScatterForwardAllGatherBackward.apply(z, group)
    assert torch.equal(w, torch.full((1, 2), 3.0 if r == 0 else 30.0))
    w.backward(torch.full((1, 2), r + 1.0))
    assert torch.equal(z.grad, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))

    # dispatch and combine on the hand-written routing
    def tokens_of(src):
        return torch.arange(T * 2, dtype=torch.float32).view(T, 2) + 100.0 * src  # (T, 2)
    x = tokens_of(r).requires_grad_()
    weights = (torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]]) + 0.01 * r).requires_grad_()
    experts = torch.tensor(ROUTES[r])
    with record_comm(ps) as events:
        _, perm = permute_tokens(x[:, :0], experts, E)
        rows, state = allgather_dispatch(x, weights, perm, group)
        # my experts' rows, by (local expert, source rank, token)
        want = [tokens_of(src)[t] for e in (2 * r, 2 * r + 1) for src in (0, 1) for t in range(T)
                for j in range(K) if ROUTES[src][t][j] == e]
        assert torch.equal(rows, torch.stack(want))
        counts = [sum(row.count(e) for src in (0, 1) for row in ROUTES[src]) for e in (2 * r, 2 * r + 1)]
        assert state.offsets.tolist() == [counts[0], counts[0] + counts[1]]  # on the device
        scale = torch.repeat_interleave(torch.tensor(SCALE[2 * r:2 * r + 2]), torch.tensor(counts))
        out = allgather_combine(rows * scale.unsqueeze(1), state, group)           # (T, 2)
        c = torch.tensor(SCALE)[experts]                                           # (T, K)
        torch.testing.assert_close(out, (weights * c).sum(1, keepdim=True) * x)
        out.sum().backward()
    # d out.sum() / dx[t] = sum_k w c; / dw[t, k] = c[t, k] * sum(x[t])
    torch.testing.assert_close(x.grad, (weights * c).sum(1, keepdim=True).expand(T, 2).detach())
    torch.testing.assert_close(weights.grad, c * x.detach().sum(1, keepdim=True))
    ops = [(ev.op, ev.group) for ev in events]
    # forward: routing table, tokens, weights gathered, output reduce-scattered; backward: the
    # output's gradient gathered, the weights' and tokens' gradients reduce-scattered
    assert ops[:4] == [("all_gather", "ep")] * 3 + [("reduce_scatter", "ep")], ops
    assert sorted(ops[4:]) == [("all_gather", "ep")] + [("reduce_scatter", "ep")] * 2, ops
    assert events[1].payload_bytes == T * 2 * 4  # this rank's tokens
    return True


# ---- one layer: allgather == alltoall in the layout, == serial once reduced ----------------------

H, B, S = 16, 8, 4
LAYER = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12)
LAYER_CASES = [  # (name, experts' kind and bias, MoE fields)
    ("gelu dropless", "gelu", True, {}),
    ("swiglu dropless", "swiglu", False, {}),
    ("gelu capacity", "gelu", True, {"moe_expert_capacity_factor": 0.75}),
    ("swiglu padded", "swiglu", False, {"moe_expert_capacity_factor": 1.0,
                                        "moe_pad_expert_input_to_capacity": True}),
]


def _layer_run(ps, kind, bias, fields, dispatcher, x, probe):
    cfg = GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=S,
                    vocab_size=64, seed=SEED, moe_token_dispatcher_type=dispatcher, **LAYER, **fields)
    layer = MoELayer(cfg, ps, LayerContext(Initializer(SEED, cfg.init_std)), "layers.1.mlp",
                     kind=kind, bias=bias)
    x = x.clone().requires_grad_()
    with record_comm(ps) as events:
        out = layer(x)
        (out * probe).sum().backward()
    grads = logical_grads(layer)  # each expert's own blocks of the stacked gradients
    return (out.detach(), x.grad, grads, {ev.op for ev in events if ev.group == "ep"},
            float(layer.totals.dropped))  # (0 when dropless: nothing counted)


def _layer_checks(ps, ep: int, cases=LAYER_CASES) -> list[str]:
    init_expert_groups(ps, ep)
    dp, rank = ps.dp_cp_group.size, ps.dp_cp_group.rank
    gen = torch.Generator().manual_seed(SEED)
    xs, probes = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    mine = slice(rank * B // dp, (rank + 1) * B // dp)
    done = []
    for name, kind, bias, fields in cases:
        got = _layer_run(ps, kind, bias, fields, "allgather", xs[mine], probes[mine])
        ref = _layer_run(ps, kind, bias, fields, "alltoall", xs[mine], probes[mine])
        assert got[3] == {"all_gather", "reduce_scatter"} and ref[3] == {"all_to_all"}, name
        for what, a, b in (("output", got[0], ref[0]), ("input grad", got[1], ref[1])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, w=what: f"{name} {w}: {m}")
        assert got[2].keys() == ref[2].keys()
        for n in ref[2]:
            torch.testing.assert_close(got[2][n], ref[2][n], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n: f"{name} {n}: {m}")
        # serial: the same micro-batches (capacity is per micro-batch), gradients summed
        serial = ParallelState.serial(backend_rules=ps.comm.rules_name)
        runs = [_layer_run(serial, kind, bias, fields, "alltoall", xs[i * B // dp:(i + 1) * B // dp],
                           probes[i * B // dp:(i + 1) * B // dp]) for i in range(dp)]
        torch.testing.assert_close(got[0], runs[rank][0], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got[1], runs[rank][1], rtol=1e-5, atol=1e-6, msg=name)
        for n, g in got[2].items():
            g = g.clone()
            (ps.edp_group if n.startswith("experts.experts.") else ps.dp_cp_group).all_reduce(g)
            want = sum(run[2][n] for run in runs)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=n: f"{name} {n} vs serial: {m}")
        held = {n.split(".")[2] for n in got[2] if n.startswith("experts.experts.")}
        assert len(held) == E // ep, held
        if fields.get("moe_expert_capacity_factor") == 0.75:  # E C < T K: some assignments drop
            assert got[4] > 0 and got[4] == ref[4], name
        done.append(name)
    return done


# ---- training against serial ---------------------------------------------------------------------

GROUPED = {**LLAMA, "moe_grouped_gemm": True}


def _train_checks(ps, cases) -> list[str]:
    """Each (ep, model fields, micro-batches per rank, serial micro-batches): the allgather
    layout's figures against the serial run's."""
    done = []
    for ep, kind, micro, serial_micro in cases:
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=64, seed=SEED, moe_token_dispatcher_type="allgather", **kind)
        serial = train(ParallelState.serial(backend_rules=ps.comm.rules_name), cfg, serial_micro)
        init_expert_groups(ps, ep)
        snap = ps.comm.snapshot()
        layout = train(ps, cfg, micro)
        assert ps.comm.since(snap)["ep"]["payload_bytes"] > 0
        name = f"ep={ep} dp={ps.dp_cp_group.size} {kind['block']}"
        for step, (a, b) in enumerate(zip(serial, layout), start=1):
            for what, x, y in zip(("loss", "balancing loss", "grad norm"), a, b):
                assert abs(x - y) <= REL * max(abs(x), 1e-6), \
                    f"{name} step {step}: {what} {y} != serial {x}"
        assert serial[0][1] > 0
        done.append(name)
    return done


def _dp2(ps):
    return (_patterns(ps), _layer_checks(ps, 2),
            _train_checks(ps, [(2, GPT2, 1, 1)]))


def _dp4(ps):
    return (_layer_checks(ps, 4, [LAYER_CASES[0], LAYER_CASES[3]]),
            _train_checks(ps, [(4, GROUPED, 1, 2)]))


def test_allgather_patterns_and_ep2_dp2_equal_alltoall_and_serial():
    results = run_distributed(_dp2, grid=RankGrid(dp=2))
    assert all(r[0] for r in results) and len(results[0][1]) == len(LAYER_CASES)
    assert len(results[0][2]) == 1


def test_allgather_ep4_dp4_equals_alltoall_and_serial():
    results = run_distributed(_dp4, grid=RankGrid(dp=4))
    assert len(results[0][0]) == 2 and len(results[0][1]) == 1


def test_dispatcher_flag():
    from engine.base import ConfigError
    from engine.config.cli import parse_args
    base = ["--mock-data", "--vocab-size", "64", "--num-experts", "4"]
    cfg = parse_args(base + ["--moe-token-dispatcher-type", "allgather", "--moe-grouped-gemm"])
    assert cfg.model.moe_token_dispatcher_type == "allgather" and cfg.model.moe_grouped_gemm
    with pytest.raises(ConfigError, match="invalid choice: 'flex'"):
        parse_args(base + ["--moe-token-dispatcher-type", "flex"])
    with pytest.raises(ValueError, match="use one of alltoall, allgather"):
        GPTConfig(num_experts=4, moe_token_dispatcher_type="flex")
