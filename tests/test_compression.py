"""Gradient compressors (int8, top-k with error feedback) and the per-branch policy, on gloo."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from parallel.comm import wire_bytes
from parallel.dp import (CompressionPolicy, CompressorSpec, DistributedOptimizer, GradReducer,
                         Int8Compressor, PolicyError, TopKCompressor)
from parallel.state import ParallelState
from parallel.topology import RankGrid
from tests.dist_utils import gather_tensors, record_comm, run_distributed
from tests.test_dp_reducer import backward_step, make_model, serial_grads

N = 50_000
POLICY = {"default": "none", "warmup_steps": 1, "rules": [
    {"pattern": "*embed*", "compressor": "none"},
    {"pattern": "*attn*", "compressor": "int8", "chunk_size": 64},
    {"pattern": "*mlp*", "compressor": "topk", "ratio": 0.05}]}


def rank_input(rank: int, step: int = 0) -> torch.Tensor:
    """Gradient-like values whose magnitude varies by orders across the buffer."""
    g = torch.Generator().manual_seed(17 * rank + 1000 * step)
    return torch.randn(N, generator=g) * torch.logspace(-3, 1, N)[torch.randperm(N, generator=g)]


def gather(ps, t: torch.Tensor) -> list[torch.Tensor]:
    return gather_tensors(ps.dp_group, t)


def reference_bytes(p: int) -> int:
    return wire_bytes("all_reduce", N * 4, p)


def check_int8(ps) -> None:
    p, c = ps.dp_size, 256
    x = rank_input(ps.rank)
    inputs = gather(ps, x)
    truth = torch.stack(inputs).sum(0)
    out = x.clone()
    with record_comm(ps) as events:
        Int8Compressor(chunk_size=c).all_reduce_(out, ps.dp_group)
    assert all(torch.equal(o, out) for o in gather(ps, out))          # replicas stay identical
    assert [e.op for e in events] == ["all_to_all", "all_gather"]
    assert sum(e.wire_bytes for e in events) <= 0.27 * reference_bytes(p)
    # per chunk: p phase-1 errors of max|x_r|/254 each, one phase-2 error of max|sum|/254
    padded = math.ceil(N / (p * c)) * p * c
    def chunk_amax(t):                                                 # (chunks,)
        return torch.nn.functional.pad(t.abs(), (0, padded - N)).view(-1, c).amax(1)
    e1 = sum(chunk_amax(t) for t in inputs) / 254
    bound = e1 + (chunk_amax(truth) + e1) / 254
    err = torch.nn.functional.pad((out - truth).abs(), (0, padded - N)).view(-1, c)
    assert bool((err <= bound.unsqueeze(1) * (1 + 1e-5) + 1e-7).all())
    assert err.max() > 0                                               # it really quantized


def check_topk(ps) -> None:
    p, steps = ps.dp_size, 5
    comp = TopKCompressor(ratio=0.01)
    sent, truth = torch.zeros(N), torch.zeros(N)
    for step in range(steps):
        x = rank_input(ps.rank, step)
        truth += torch.stack(gather(ps, x)).sum(0)
        out = x.clone()
        with record_comm(ps) as events:
            comp.all_reduce_(out, ps.dp_group)
        assert all(torch.equal(o, out) for o in gather(ps, out))
        assert [e.op for e in events] == ["all_to_all", "all_gather"]
        assert sum(e.wire_bytes for e in events) <= 0.03 * reference_bytes(p)
        assert int((out != 0).sum()) <= 0.01 * N + p
        sent += out
    residual = comp.residual.clone()
    ps.dp_group.all_reduce(residual)
    owner = torch.cat(gather(ps, comp.owner_residual))[:N]
    # error feedback: everything not sent yet is still held in a residual
    torch.testing.assert_close(sent + residual + owner, truth, rtol=1e-5, atol=1e-4)
    assert (residual + owner).abs().max() > 1.0                        # it really held values back
    state = comp.state_dict()
    assert set(state) == {"residual", "owner_residual"}


def check_policy_reducer(ps) -> None:
    model = make_model()
    reducer = GradReducer(model, ps, bucket_size_mb=100 * 4 / 2 ** 20, compression_policy=POLICY)
    kinds = {b.spec.kind for b in reducer.buckets}
    assert kinds == {"none", "int8", "topk"}
    for b in reducer.buckets:                                          # never mixes compressors
        assert all(reducer.policy.compressor_for(s.name) == b.spec for s in b.slots)
    for step in (1, 2, 3):
        reducer.zero_grad()
        backward_step(model, reducer, step, ps.dp_size, ps.dp_rank, m=1)
        reference = serial_grads(step)
        compressed = step > POLICY["warmup_steps"]
        n_comp = sum(b.compressor is not None for b in reducer.buckets)
        assert reducer.stats()["calls"] == len(reducer.buckets) + (n_comp if compressed else 0)
        for bucket in reducer.buckets:
            assert all(torch.equal(o, bucket.data) for o in gather(ps, bucket.data))
            for slot in bucket.slots:
                got, want = slot.param.main_grad, reference[slot.name]
                if not compressed or bucket.spec.kind == "none":
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
                elif bucket.spec.kind == "int8":
                    assert (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-7
    assert reducer.state_dict()["residuals"]


def check_policy_with_zero(ps) -> None:
    """Under ZeRO-1 a compressed bucket still yields this rank's shard of the same exchange."""
    size = 100 * 4 / 2 ** 20
    plain_model, zero_model = make_model(), make_model()
    plain = GradReducer(plain_model, ps, bucket_size_mb=size, compression_policy=POLICY)
    zero = GradReducer(zero_model, ps, bucket_size_mb=size, compression_policy=POLICY)
    opt = DistributedOptimizer(zero_model, zero, ps)
    for step in (1, 2, 3):
        for model, reducer in ((plain_model, plain), (zero_model, zero)):
            reducer.zero_grad()
            backward_step(model, reducer, step, ps.dp_size, ps.dp_rank, m=1)
        for piece in opt.pieces:
            got = piece.param.main_grad_shard
            want = dict(plain_model.named_parameters())[piece.name].main_grad.reshape(-1)[piece.start:piece.end]
            if step > 1 and zero.buckets[piece.bucket].compressor is not None:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def all_checks(ps: ParallelState) -> bool:
    check_int8(ps)
    check_topk(ps)
    check_policy_reducer(ps)
    check_policy_with_zero(ps)
    return True


@pytest.mark.parametrize("dp", [2, 4])
def test_compressors_on_gloo(dp):
    assert all(run_distributed(all_checks, grid=RankGrid(dp=dp)))


def test_policy_mapping_first_match_and_warmup():
    policy = CompressionPolicy.from_dict(POLICY)
    assert policy.compressor_for("embed.weight").kind == "none"
    assert policy.compressor_for("layers.0.attn.qkv.weight") == CompressorSpec("int8", chunk_size=64)
    assert policy.compressor_for("layers.0.mlp.fc1.weight") == CompressorSpec("topk", ratio=0.05)
    assert policy.compressor_for("final_norm.weight").kind == "none"
    first = CompressionPolicy.from_dict({"rules": [{"pattern": "*mlp*", "compressor": "int8"},
                                                   {"pattern": "*fc1*", "compressor": "topk"}]})
    assert first.compressor_for("mlp.fc1.weight").kind == "int8"
    assert not policy.active(1) and policy.active(2)
    assert CompressionPolicy.from_dict({"default": {"compressor": "topk", "ratio": 0.1}}) \
        .compressor_for("x").build().ratio == 0.1
    assert CompressionPolicy.uniform("topk", 0.02).compressor_for("x") == CompressorSpec("topk", 0.02)
    assert CompressionPolicy.uniform("none").compressor_for("x").build() is None
    flags = SimpleNamespace(grad_compression="int8", grad_compression_ratio=0.01, grad_compression_policy=None)
    assert CompressionPolicy.coerce(flags).compressor_for("x").kind == "int8"
    flags.grad_compression_policy = POLICY
    assert CompressionPolicy.coerce(flags) == policy


@pytest.mark.parametrize("policy, key", [
    ({"rules": [{"pattern": "*", "compressor": "int4"}]}, "rules[0].compressor"),
    ({"rules": [{"pattern": "*", "compressor": "topk", "ratio": 0.0}]}, "rules[0].ratio"),
    ({"rules": [{"pattern": "*", "compressor": "topk", "ratio": 1.5}]}, "rules[0].ratio"),
    ({"rules": [{"pattern": 3, "compressor": "int8"}]}, "rules[0].pattern"),
    ({"rules": [{"pattern": "*", "compressor": "int8", "ratio": 0.1}]}, "rules[0].ratio"),
    ({"rules": [{"pattern": "*"}]}, "rules[0].compressor"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"default": "zip"}, "default.compressor"),
    ({"warmup": 3}, "warmup"),
])
def test_invalid_policies_name_the_key(policy, key):
    with pytest.raises(PolicyError) as info:
        CompressionPolicy.from_dict(policy)
    assert str(info.value).startswith(key + ":"), str(info.value)


def test_byte_model():
    assert wire_bytes("all_reduce", 400, 4) == 600
    assert wire_bytes("reduce_scatter", 400, 4) == wire_bytes("all_to_all", 400, 4) == 300
    assert wire_bytes("all_gather", 100, 4) == 300
    assert wire_bytes("all_reduce", 400, 1) == 0
    assert wire_bytes("send", 100, 2) == 100
