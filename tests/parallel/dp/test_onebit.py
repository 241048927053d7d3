"""1-bit Adam (parallel/dp/onebit.py): the two-phase sign exchange against a hand computation on
2 and 4 ranks, error feedback on both sides, the momentum exchange, both optimizers after the
warm-up, and a skipped step putting the momentum back; the warm-up and refresh schedule."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from parallel.runtime.comm_monitor import wire_bytes
from parallel.dp import (CompressionPolicy, DistributedOptimizer, GradReducer,
                         MixedPrecisionOptimizer, OneBitCompressor, PolicyError)
from parallel.dp.onebit import pack_signs, unpack_signs
from parallel.dp.warmup import refresh_steps, resolve_warmup
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import gather_tensors, record_comm, run_distributed
from tests.helpers.linear_model import Linear, full_state

N, C = 5_000, 64


def rank_input(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * rank + 977 * step)
    return torch.randn(N, generator=g) * torch.logspace(-2, 1, N)[torch.randperm(N, generator=g)]


def sign_compress(rows: torch.Tensor) -> torch.Tensor:
    """By hand: each chunk of C values -> sign(v) (0 counts as +) times the chunk's mean |v|."""
    r, w = rows.shape
    ch = rows.view(r, w // C, C)
    return torch.where(ch >= 0, 1.0, -1.0).mul(ch.abs().mean(-1, keepdim=True)).view(r, w)


def two_phase_by_hand(inputs, residuals, owners, p):
    """The whole exchange for every rank at once: (output, new residuals, new owner residuals)."""
    m = math.ceil(N / p)
    width = math.ceil(m / C) * C

    def rows(t):
        full = torch.zeros(p * m)
        full[:N] = t
        return torch.nn.functional.pad(full.view(p, m), (0, width - m))

    xs = [rows(x) + rows(r) for x, r in zip(inputs, residuals)]
    sent = [sign_compress(x) for x in xs]
    new_res = [(x - s).reshape(p, width)[:, :m].reshape(-1)[:N] for x, s in zip(xs, sent)]
    out_rows, new_owner = [], []
    for j in range(p):
        shard = sum(s[j] for s in sent).clone()
        shard[:m] += owners[j]
        back = sign_compress(shard.unsqueeze(0))[0]
        new_owner.append((shard - back)[:m])
        out_rows.append(back[:m])
    return torch.cat(out_rows)[:N], new_res, new_owner


def check_exchange(ps) -> None:
    p = ps.dp_size
    comp = OneBitCompressor(chunk_size=C)
    m = math.ceil(N / p)
    residuals, owners = [torch.zeros(N)] * p, [torch.zeros(m)] * p
    sent_total, truth = torch.zeros(N), torch.zeros(N)
    for step in range(3):
        x = rank_input(ps.rank, step)
        inputs = gather_tensors(ps.dp_group, x)
        want, residuals, owners = two_phase_by_hand(inputs, residuals, owners, p)
        out = x.clone()
        with record_comm(ps) as events:
            comp.sign_all_reduce_(out, ps.dp_group)
        assert [e.op for e in events] == ["all_to_all", "all_gather"]
        # signs and one fp32 scale per 64 values: 1/32 + 1/64 of an fp32 all-reduce
        assert sum(e.wire_bytes for e in events) <= 0.05 * wire_bytes("all_reduce", 4 * N, p)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comp.residual, residuals[ps.rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comp.owner_residual, owners[ps.rank], rtol=1e-5, atol=1e-6)
        assert all(torch.equal(o, out) for o in gather_tensors(ps.dp_group, out))
        sent_total += out
        truth += torch.stack(inputs).sum(0)
    # error feedback: what was delivered plus every residual is what was to be sent
    res = comp.residual.clone()
    ps.dp_group.all_reduce(res)
    owner = torch.cat(gather_tensors(ps.dp_group, comp.owner_residual))[:N]
    torch.testing.assert_close(sent_total + res + owner, truth, rtol=1e-5, atol=1e-4)
    assert (res + owner).abs().max() > 0.1


def check_momentum_exchange(ps) -> None:
    """m_r = beta1 M + (1 - beta1) g_r is what is compressed; M is kept unscaled; ZeRO's form
    runs both phases and hands out this rank's shard; a skipped step puts M back."""
    p, beta1, scale = ps.dp_size, 0.8, 8.0
    comp = OneBitCompressor(chunk_size=C, beta1=beta1)
    comp.loss_scale = lambda: scale
    M = torch.linspace(-1, 1, N)
    comp.set_momentum(M)
    g = rank_input(ps.rank, 5) * scale / p                  # as the reducer hands it over
    inputs = gather_tensors(ps.dp_group, g * (1 - beta1) + M * (beta1 * scale / p))
    m = math.ceil(N / p)
    want, _, _ = two_phase_by_hand(inputs, [torch.zeros(N)] * p, [torch.zeros(m)] * p, p)
    shard = torch.empty(N // p)
    with record_comm(ps) as events:
        comp.reduce_scatter_(g.clone(), ps.dp_group, shard)
    assert [e.op for e in events] == ["all_to_all", "all_gather"]
    lo = ps.dp_rank * (N // p)
    torch.testing.assert_close(shard, want[lo:lo + N // p], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comp.momentum, want / scale, rtol=1e-5, atol=1e-6)
    assert set(comp.state_dict()) == {"residual", "owner_residual", "momentum"}
    comp.reset()                                            # the step was skipped
    assert torch.equal(comp.momentum, M) and float(comp.residual.abs().sum()) == 0
    # ZeRO seeding: shards of M are gathered by the next exchange
    fresh = OneBitCompressor(chunk_size=C, beta1=0.0)
    fresh.set_momentum_shard(M[lo:lo + N // p])
    with record_comm(ps) as events:
        fresh.all_reduce_(torch.zeros(N), ps.dp_group)
    assert [e.op for e in events] == ["all_gather", "all_to_all", "all_gather"]
    assert torch.equal(fresh._previous, M)


def check_seed_on_the_exchange_stream(ps) -> bool:
    """Under ZeRO the seed shard is made on the compute stream and all-gathered by the exchange
    worker on its side stream, synchronously: NCCL (torch >= 2.8) runs that gather on the side
    stream and keeps nothing alive, so dropping the seed must wait for that stream (the stream
    checker models it so). The worker drops it; its block's release is then safe."""
    from parallel.dp.exchange import ExchangeWorker
    from parallel.runtime import streams
    from parallel.runtime.stream_check import StreamChecker
    p = ps.dp_size
    lo = ps.dp_rank * (N // p)
    checker = StreamChecker()
    with checker.installed():
        exp_avg = torch.linspace(-1, 1, N)                      # the optimizer's, on compute
        comp = OneBitCompressor(chunk_size=C, beta1=0.0)
        comp.set_momentum_shard(exp_avg[lo:lo + N // p])
        seed = comp._seed_shard
        worker = ExchangeWorker(torch.device("cpu"))
        try:
            worker.submit(comp.all_reduce_, torch.zeros(N), ps.dp_exchange_group)
            assert comp._seed_shard is None
            # the worker dropped the seed: the compute stream's pool may hand its block out now,
            # before the exchange is drained (Python's last reference, the test's, stands in)
            streams.released(seed)
            worker.drain()
        finally:
            worker.close()
        assert torch.equal(comp._previous, exp_avg)
    return checker.violations


def check_optimizers(ps) -> None:
    """Warm-up W = 2 of plain AdamW, then: the compressor's M is seeded from exp_avg, exp_avg
    becomes the exchanged M, v stays frozen, and w moves by lr * M / (1 - b1^t) / (sqrt(v) + eps);
    no ZeRO, ZeRO-1 and ZeRO-2 agree and replicas stay identical."""
    lr, betas, eps, warm = 0.01, (0.9, 0.99), 1e-8, 2
    policy = {"default": {"compressor": "onebit", "chunk_size": C}, "warmup_steps": warm,
              "variance_refresh": "off"}
    finals = []
    for stage in (0, 1, 2):
        model = Linear(N)
        reducer = GradReducer(model, ps, compression_policy=policy)
        reducer.loss_scaler = SimpleNamespace(scale=1.0)
        cls = DistributedOptimizer if stage else MixedPrecisionOptimizer
        opt = cls([("w", model.w)], reducer, ps, lr=lr, betas=betas, eps=eps,
                  **({"zero_stage": stage} if stage else {}))
        bucket = reducer.buckets[0]
        for step in range(1, 6):
            opt.zero_grad()
            reducer.set_last_microbatch(True)
            model(rank_input(ps.dp_rank, step)).backward()
            reducer.finish()
            before = model.w.detach().clone()
            v = full_state(ps, opt, stage, "exp_avg_sq", N)
            m_before = full_state(ps, opt, stage, "exp_avg", N)
            opt.step(lr)
            if stage:
                opt.finish_param_gather()
            if step == warm + 1:                                 # seeded from the warm-up's m
                torch.testing.assert_close(bucket.compressor._previous[:N], m_before)
            if step == warm + 1:                                 # frozen, bias-corrected
                v = v / (1 - betas[1] ** warm)
            if step > warm:
                M = bucket.compressor.momentum[:N]
                torch.testing.assert_close(full_state(ps, opt, stage, "exp_avg", N), M)
                torch.testing.assert_close(full_state(ps, opt, stage, "exp_avg_sq", N), v)
                delta = -lr * M / (1 - betas[0] ** step) / (v.sqrt() + eps)
                torch.testing.assert_close(model.w.detach() - before, delta, rtol=1e-4, atol=1e-7)
            assert all(torch.equal(o, model.w.detach()) for o in gather_tensors(ps.dp_group, model.w.detach()))
        finals.append(model.w.detach().clone())
        reducer.remove_hooks()
    # (no ZeRO runs torch's AdamW in the warm-up: sign flips make it differ beyond rounding)
    assert torch.equal(finals[1], finals[2])


def check_skipped_last_warmup_step(ps) -> None:
    """The warm-up's last step W skipped (an overflow: the Stepper calls the reducer's
    ``step_skipped`` and the optimizer's ``skipped_step`` instead of ``step``): the warm-up counts
    applied updates, so step W runs again uncompressed, and the first compressed step's M is the
    exp_avg that applied step W left, not zero, under every ZeRO stage."""
    lr, warm = 0.01, 3
    policy = {"default": {"compressor": "onebit", "chunk_size": C}, "warmup_steps": warm,
              "variance_refresh": "off"}
    for stage in (0, 1, 2):
        model = Linear(N)
        reducer = GradReducer(model, ps, compression_policy=policy)
        reducer.loss_scaler = SimpleNamespace(scale=1.0)
        cls = DistributedOptimizer if stage else MixedPrecisionOptimizer
        opt = cls([("w", model.w)], reducer, ps, lr=lr, **({"zero_stage": stage} if stage else {}))
        compressed = []
        for step in range(1, warm + 3):
            opt.zero_grad()
            reducer.set_last_microbatch(True)
            model(rank_input(ps.dp_rank, step)).backward()
            reducer.finish()
            compressed.append(reducer.buckets[0].compressed_step)
            m_before = full_state(ps, opt, stage, "exp_avg", N)
            if step == warm:
                reducer.step_skipped()
                opt.skipped_step()
                continue
            opt.step(lr)
            if stage:
                opt.finish_param_gather()
        assert compressed == [False] * (warm + 1) + [True] and reducer.step == warm + 2
        assert m_before.abs().max() > 0
        torch.testing.assert_close(reducer.buckets[0].compressor._previous[:N], m_before)
        reducer.remove_hooks()


def all_checks(ps) -> list:
    check_exchange(ps)
    check_momentum_exchange(ps)
    check_optimizers(ps)
    check_skipped_last_warmup_step(ps)
    return check_seed_on_the_exchange_stream(ps)


@pytest.mark.parametrize("dp", [2, 4])
def test_onebit_on_gloo(dp):
    assert run_distributed(all_checks, grid=RankGrid(dp=dp)) == [[]] * dp


def test_sign_packing_roundtrip():
    x = torch.randn(3, 64)
    assert torch.equal(unpack_signs(pack_signs(x >= 0), 64), x >= 0)
    assert pack_signs(torch.ones(1, 8, dtype=torch.bool)).tolist() == [[255]]


def test_warmup_sized_by_the_run_and_refresh_schedule():
    assert CompressionPolicy.uniform("onebit", train_iters=600).warmup_steps == 90
    assert CompressionPolicy.uniform("topk", warmup_fraction=0.2, train_iters=600).warmup_steps == 120
    assert CompressionPolicy.uniform("topk", warmup_steps=7, train_iters=600).warmup_steps == 7
    assert CompressionPolicy.uniform("int8", train_iters=600).warmup_steps == 4
    assert CompressionPolicy.from_dict({"default": "onebit", "warmup_fraction": 0.25},
                                       train_iters=40).warmup_steps == 10
    assert resolve_warmup(None, 0.15, None, True) == 4
    flags = SimpleNamespace(grad_compression="onebit", grad_compression_ratio=0.01,
                            grad_compression_policy=None, grad_compression_warmup_steps=None,
                            grad_compression_warmup_fraction=0.1,
                            grad_compression_variance_refresh="off")
    policy = CompressionPolicy.coerce(flags, train_iters=100)
    assert policy.warmup_steps == 10 and policy.variance_refresh == 0
    assert refresh_steps(10, "exp", 50) == [11, 12, 14, 18, 26, 42]
    assert refresh_steps(10, 0, 50) == []
    assert refresh_steps(10, 15, 50) == [11, 25, 40]
    assert CompressionPolicy.uniform("topk", warmup_steps=3, variance_refresh="7").variance_refresh == 7


@pytest.mark.parametrize("policy, key", [
    ({"default": "onebit", "warmup_steps": 0}, "warmup_steps"),
    ({"default": {"compressor": "onebit", "chunk_size": 12}}, "default.chunk_size"),
    ({"default": {"compressor": "onebit", "ratio": 0.1}}, "default.ratio"),
    ({"default": "onebit", "variance_refresh": "sometimes"}, "variance_refresh"),
    ({"default": "onebit", "warmup_fraction": 1.5}, "warmup_fraction"),
])
def test_invalid_onebit_policies_name_the_key(policy, key):
    with pytest.raises(PolicyError) as info:
        CompressionPolicy.from_dict(policy)
    assert str(info.value).startswith(key + ":"), str(info.value)
