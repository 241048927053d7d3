"""Gradient compressors (int8 and top-k, error feedback on both sides), their ZeRO form (phase 1
only), the DP average of the local variance statistics, and the per-branch policy, on gloo."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from parallel.runtime.comm_monitor import wire_bytes
from parallel.dp import (CompressionPolicy, CompressorSpec, DistributedOptimizer, GradReducer,
                         Int8Compressor, LocalVariance, PolicyError, TopKCompressor)
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import gather_tensors, record_comm, run_distributed
from tests.parallel.dp.test_dp_reducer import backward_step, make_model, serial_grads

N = 50_000
POLICY = {"default": "none", "warmup_steps": 1, "variance_refresh": "exp", "rules": [
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


def shard_chunks(t: torch.Tensor, p: int, c: int) -> torch.Tensor:
    """(p * chunks, c): every shard of m = N / p values cut into chunks of c, zero-padded."""
    m = N // p
    width = math.ceil(m / c) * c
    return torch.nn.functional.pad(t.view(p, m), (0, width - m)).view(-1, c)


def check_int8(ps) -> None:
    p, c = ps.dp_size, 256
    x = rank_input(ps.rank)
    inputs = gather(ps, x)
    truth = torch.stack(inputs).sum(0)
    out = x.clone()
    comp = Int8Compressor(chunk_size=c)
    with record_comm(ps) as events:
        comp.all_reduce_(out, ps.dp_group)
    assert all(torch.equal(o, out) for o in gather(ps, out))          # replicas stay identical
    assert [e.op for e in events] == ["all_to_all", "all_gather"]
    assert sum(e.wire_bytes for e in events) <= 0.27 * reference_bytes(p)
    # per chunk of each shard: p phase-1 errors of max|x_r|/254, one phase-2 error of max|sum|/254
    def chunk_amax(t):                                                 # (chunks,)
        return shard_chunks(t.abs(), p, c).amax(1)
    e1 = sum(chunk_amax(t) for t in inputs) / 254
    bound = e1 + (chunk_amax(truth) + e1) / 254
    err = shard_chunks((out - truth).abs(), p, c)
    assert bool((err <= bound.unsqueeze(1) * (1 + 1e-5) + 1e-7).all())
    assert err.max() > 0                                               # it really quantized
    # error feedback: the rounding errors of both phases are kept, and sent with the next step
    assert comp.residual.abs().max() > 0 and comp.owner_residual.abs().max() > 0
    check_error_feedback(ps, comp, steps=3, first=out, truth=truth)


def check_error_feedback(ps, comp, steps: int, first=None, truth=None, sharded: bool = False):
    """Over ``steps`` exchanges: outputs plus every residual equal the summed inputs."""
    p = ps.dp_size
    sent = torch.zeros(N) if first is None else first.clone()
    truth = torch.zeros(N) if truth is None else truth.clone()
    for step in range(1, steps):
        x = rank_input(ps.rank, step)
        truth += torch.stack(gather(ps, x)).sum(0)
        out = x.clone()
        if sharded:
            shard = torch.empty(N // p)
            comp.reduce_scatter_(out, ps.dp_group, shard)
            out = torch.cat(gather(ps, shard))
        else:
            comp.all_reduce_(out, ps.dp_group)
        sent += out
    residual = comp.residual.clone()
    ps.dp_group.all_reduce(residual)
    owner = torch.zeros(N) if sharded else torch.cat(gather(ps, comp.owner_residual))[:N]
    torch.testing.assert_close(sent + residual + owner, truth, rtol=1e-5, atol=1e-4)
    return residual + owner


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
        # (int32 index, bf16 value) per kept entry: 1.5 x the ratio of an fp32 all-reduce
        assert sum(e.wire_bytes for e in events) <= 0.016 * reference_bytes(p)
        assert int((out != 0).sum()) <= 0.01 * N + p
        sent += out
    residual = comp.residual.clone()
    ps.dp_group.all_reduce(residual)
    owner = torch.cat(gather(ps, comp.owner_residual))[:N]
    # error feedback: everything not sent yet is still held in a residual
    torch.testing.assert_close(sent + residual + owner, truth, rtol=1e-5, atol=1e-4)
    assert (residual + owner).abs().max() > 1.0                        # it really held values back
    assert set(comp.state_dict()) == {"residual", "owner_residual"}
    # a skipped step (a non-finite gradient) gets the pending residuals back, not zeros
    held = comp.residual.clone(), comp.owner_residual.clone()
    comp.all_reduce_(torch.full((N,), float("nan")), ps.dp_group)
    comp.reset()
    assert torch.equal(comp.residual, held[0]) and torch.equal(comp.owner_residual, held[1])
    comp.reset()                                                       # nothing more to undo
    assert torch.equal(comp.residual, held[0])


def check_sharded_exchanges(ps) -> None:
    """ZeRO: phase 1 only; rank j gets the exact sum of what was sent of shard j, half the bytes
    of the two-phase exchange, and error feedback stays exact."""
    p = ps.dp_size
    for comp, limit in ((Int8Compressor(256), 0.135), (TopKCompressor(0.01), 0.008)):
        x = rank_input(ps.rank, 7)
        shard = torch.empty(N // p)
        with record_comm(ps) as events:
            comp.reduce_scatter_(x.clone(), ps.dp_group, shard)
        assert [e.op for e in events] == ["all_to_all"]
        assert sum(e.wire_bytes for e in events) <= limit * reference_bytes(p)
        assert comp.owner_residual is None
        # what this rank's shard received: the sum over ranks of what they sent of it
        sent_here = rank_input(ps.rank, 7) - comp.residual
        total = torch.stack(gather(ps, sent_here)).sum(0)
        lo = ps.dp_rank * (N // p)
        torch.testing.assert_close(shard, total[lo:lo + N // p], rtol=1e-5, atol=1e-5)
        check_error_feedback(ps, type(comp)(*((256,) if comp.name == "int8" else (0.01,))),
                             steps=3, sharded=True)


def check_variance_average(ps) -> None:
    """The local squared-gradient statistics averaged over DP in log-domain uint8: within the
    quantization's relative bound of the exact mean, identical on every rank (full), and the
    owner's shard under ZeRO; zeros stay exactly zero."""
    p = ps.dp_size
    var = LocalVariance(N, torch.device("cpu"))
    for step in range(3):
        g = rank_input(ps.rank, step)
        g[:100] = 0.0                                      # never-used parameters
        var.update_(g, beta2=0.95)
    exact = torch.stack(gather(ps, var.corrected(0.95))).mean(0)
    with record_comm(ps) as events:
        full = var.average(ps.dp_group, 0.95, sharded=False)
    assert [e.op for e in events] == ["all_to_all", "all_gather"]
    assert sum(e.wire_bytes for e in events) <= 0.27 * reference_bytes(p)
    assert all(torch.equal(o, full) for o in gather(ps, full))
    assert bool((full[:100] == 0).all()) and bool((full[100:] > 0).all())
    # per chunk the log2 range spans at most ~40 here: two roundings of 2^(span/508)
    rel = ((full - exact).abs() / exact.clamp_min(1e-30))[100:]
    assert rel.max() < 0.12 and rel.mean() < 0.03, (rel.max(), rel.mean())
    shard = var.average(ps.dp_group, 0.95, sharded=True)
    lo = ps.dp_rank * (N // p)
    rel = ((shard - exact[lo:lo + N // p]).abs() / exact[lo:lo + N // p].clamp_min(1e-30))
    assert rel[exact[lo:lo + N // p] > 0].max() < 0.06


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
        n_sparse = sum(b.variance is not None for b in reducer.buckets)
        refresh = 2 * n_sparse if reducer.refresh_due(step) else 0   # the variance exchange
        # the exp schedule: 1, 2, 4, ... steps after the warm-up
        assert reducer.refresh_due(step) == (step - POLICY["warmup_steps"] in (1, 2))
        assert reducer.stats()["calls"] == len(reducer.buckets) + (n_comp if compressed else 0) + refresh
        for bucket in reducer.buckets:
            assert bucket.compressed_step == (compressed and bucket.compressor is not None)
            assert all(torch.equal(o, bucket.data) for o in gather(ps, bucket.data))
            for slot in bucket.slots:
                got, want = slot.param.main_grad, reference[slot.name]
                if not compressed or bucket.spec.kind == "none":
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
                elif bucket.spec.kind == "int8":
                    assert (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-7
    assert reducer.state_dict()["residuals"]
    reducer.remove_hooks()


def check_policy_with_zero(ps) -> None:
    """Compressed buckets under ZeRO-1 and ZeRO-2 yield bit-identical gradient shards (phase 1 of
    the same exchange), and uncompressed ones the exact average."""
    size = 100 * 4 / 2 ** 20
    models = [make_model(), make_model()]
    reducers = [GradReducer(m, ps, bucket_size_mb=size, compression_policy=POLICY) for m in models]
    opts = [DistributedOptimizer(m, r, ps, zero_stage=s) for m, r, s in zip(models, reducers, (1, 2))]
    for step in (1, 2, 3):
        reference = serial_grads(step)
        for model, reducer in zip(models, reducers):
            reducer.zero_grad()
            backward_step(model, reducer, step, ps.dp_size, ps.dp_rank, m=1)
        for one, two in zip(opts[0].pieces, opts[1].pieces):
            a, b = one.param.main_grad_shard, two.param.main_grad_shard
            assert torch.equal(a, b), (step, one.name)
            if step == 1 or reducers[0].buckets[one.bucket].compressor is None:
                want = reference[one.name].reshape(-1)[one.start:one.end]
                torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-7)
        assert all(b.storage is None for b in reducers[1].buckets)     # ZeRO-2 kept only shards


def all_checks(ps: ParallelState) -> bool:
    check_int8(ps)
    check_topk(ps)
    check_sharded_exchanges(ps)
    check_variance_average(ps)
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
    ({"default": "topk", "warmup_steps": 0}, "warmup_steps"),   # Adam's second moment needs one
    ({"variance_refresh": -1}, "variance_refresh"),
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


def test_local_variance_takes_no_non_finite_sample_and_survives_a_skip():
    """An overflowed gradient (this rank's inf) leaves the statistics and their count as they
    were, and a skipped step (the reducer's ``step_skipped``) no longer wipes them: after 300
    samples and a skip, the refresh that the skipped step retries still sees 300 samples, where
    the wipe left it one (v near 0 for about 8% of the elements, 1 / sqrt(v) near 1e6)."""
    g = torch.Generator().manual_seed(0)
    var = LocalVariance(4096, torch.device("cpu"))
    for _ in range(300):
        var.update_(torch.randn(4096, generator=g), beta2=0.999)
    before, count = var.corrected(0.999).clone(), int(var.count)
    bad = torch.randn(4096, generator=g)
    bad[7] = math.inf
    var.update_(bad * 1024.0, beta2=0.999, inv_scale=1 / 1024.0)
    assert int(var.count) == count == 300 and torch.equal(var.corrected(0.999), before)
    # the reducer's skip keeps a bucket's statistics (a dp=1 reducer holds none: one is attached)
    reducer = GradReducer(make_model(), ParallelState.serial())
    bucket = reducer.buckets[0]
    bucket.variance = var
    step = reducer.step
    reducer.step_skipped()
    assert reducer.step == step - 1 and int(var.count) == 300
    assert torch.equal(var.corrected(0.999), before)
    reducer.remove_hooks()
