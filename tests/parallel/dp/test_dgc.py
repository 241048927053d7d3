"""Top-k of the momentum (parallel/dp/dgc.py, Deep Gradient Compression after the warm-up): the
exchange against a hand computation on 2 and 4 ranks (local clipping, momentum correction, top-k
per shard, factor masking, the owner's re-selection), error feedback over several steps, the
ZeRO form, the sparsity warm-up's densities and message sizes, a skipped step (undone: the run
ends where the run without it does), and the optimizer stepping with the exchanged momentum under no ZeRO, ZeRO-1 and ZeRO-2."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from parallel.dp import (CompressionPolicy, DistributedOptimizer, GradReducer,
                         MixedPrecisionOptimizer, MomentumTopKCompressor, PolicyError)
from parallel.dp.dgc import OWNER_FACTOR, ramp_density
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import gather_tensors, record_comm, run_distributed
from tests.helpers.linear_model import Linear, full_state

N, BETA1, SCALE, CLIP = 3_000, 0.8, 4.0, 0.5


def rank_grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(17 * rank + 1001 * step)
    return torch.randn(N, generator=g) * torch.logspace(-2, 1, N)[torch.randperm(N, generator=g)]


def topk_rows(x: torch.Tensor, density: float) -> torch.Tensor:
    """By hand: per row keep the ceil(density * width) largest |values|, rounded to bf16."""
    k = min(x.shape[1], max(1, math.ceil(density * x.shape[1])))
    out = torch.zeros_like(x)
    for i, row in enumerate(x):
        order = sorted(range(row.numel()), key=lambda j: -abs(float(row[j])))[:k]
        out[i, order] = row[order].to(torch.bfloat16).float()
    return out


class ByHand:
    """Every rank's state of the exchange, computed in one place from the formulas of dgc.py."""

    def __init__(self, p: int):
        self.p, self.m = p, math.ceil(N / p)
        self.u = [torch.zeros(N) for _ in range(p)]
        self.res = [torch.zeros(N) for _ in range(p)]
        self.owner = [torch.zeros(self.m) for _ in range(p)]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.p * self.m)
        full[:N] = t
        return full.view(self.p, self.m)

    def step(self, grads: list[torch.Tensor], density: float, clip: float) -> tuple:
        """``grads``: each rank's own gradient, unscaled (same arithmetic order as dgc.py, so
        that near-ties at the k-th value fall the same way)."""
        p, m, inputs, sent = self.p, self.m, [], []
        for r, g in enumerate(grads):
            flat = g * SCALE / p                          # what the reducer hands over
            bound = clip * math.sqrt(p) * SCALE / p
            norm = torch.linalg.vector_norm(flat)
            if clip > 0 and norm > bound:
                flat = flat * (bound / (norm + 1e-6))
            self.u[r] = BETA1 * self.u[r] + (1 - BETA1) * p / SCALE * flat
            inputs.append(self.u[r] * (SCALE / p))
            x = self.rows(inputs[-1]) + self.rows(self.res[r])
            s = topk_rows(x, density)
            self.res[r] = (x - s).reshape(-1)[:N]
            self.u[r] = self.u[r].masked_fill((s != 0).reshape(-1)[:N], 0.0)
            sent.append(s)
        phase1 = [torch.stack([s[j] for s in sent]).sum(0) for j in range(p)]
        owner_in = [phase1[j] + self.owner[j] for j in range(p)]   # what each owner selects from
        return owner_in, [t[:m] for t in phase1], inputs

    def owner_selected(self, owner_in: list[torch.Tensor], out: torch.Tensor, density: float):
        """Check the owners' top-k of the summed shards in ``out`` (the exchange's result) and keep
        their residuals. The sums are of bf16 values, so exact ties at the k-th magnitude happen
        and any tie rule is valid: checked is that each shard keeps k values, unchanged, none
        smaller in magnitude than one it leaves."""
        m, k = self.m, min(self.m, max(1, math.ceil(OWNER_FACTOR * density * self.m)))
        full = torch.zeros(self.p * m)
        full[:N] = out
        for j, shard in enumerate(owner_in):
            got = full[j * m:(j + 1) * m]
            kept = got != 0
            assert int(kept.sum()) == min(k, int((shard != 0).sum()))   # (2 k may exceed it)
            torch.testing.assert_close(got[kept], shard[kept].to(torch.bfloat16).float())
            assert float(shard[kept].abs().min()) >= float(shard[~kept].abs().max())
            self.owner[j] = shard - got


def check_exchange(ps) -> None:
    p, rank = ps.dp_size, ps.dp_rank
    comp = MomentumTopKCompressor(ratio=0.01, beta1=BETA1, masking=True)
    comp.loss_scale = lambda: SCALE
    hand = ByHand(p)
    delivered, wanted = torch.zeros(N), torch.zeros(N)
    for step in range(1, 6):
        comp.prepare_step(step, 3, CLIP)                  # densities 0.25, 0.05, 0.01, 0.01, ...
        grads = [rank_grad(r, step) for r in range(p)]
        owner_in, _, inputs = hand.step(grads, comp.density, CLIP)
        flat = grads[rank] * SCALE / p                    # as the reducer hands it over
        with record_comm(ps) as events:
            comp.all_reduce_(flat, ps.dp_group)
        assert [e.op for e in events] == ["all_to_all", "all_gather"]
        k = math.ceil(comp.density * hand.m)
        assert events[0].payload_bytes == p * k * 6       # (int32 index, bf16 value) per shard
        hand.owner_selected(owner_in, flat, comp.density)
        torch.testing.assert_close(comp.momentum, hand.u[rank], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(comp.residual, hand.res[rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comp.owner_residual, hand.owner[rank], rtol=1e-5, atol=1e-6)
        assert all(torch.equal(o, flat) for o in gather_tensors(ps.dp_group, flat))
        delivered += flat
        wanted += torch.stack(inputs).sum(0)
    # error feedback: what was delivered plus every residual is what was to be sent
    res = comp.residual.clone()
    ps.dp_group.all_reduce(res)
    owner = torch.cat(gather_tensors(ps.dp_group, comp.owner_residual))[:N]
    torch.testing.assert_close(delivered + res + owner, wanted, rtol=1e-5, atol=1e-4)
    assert (res + owner).abs().max() > 0.1 * wanted.abs().max()     # much is still pending
    # a skipped step puts the velocity and the pending residuals back (nothing is lost)
    before = comp.momentum.clone()
    held = comp.residual.clone(), comp.owner_residual.clone()
    comp.prepare_step(6, 3, CLIP)
    comp.all_reduce_(torch.full((N,), float("inf")), ps.dp_group)
    assert not torch.isfinite(comp.residual).all()
    comp.reset()
    assert torch.equal(comp.momentum, before)
    assert torch.equal(comp.residual, held[0]) and torch.equal(comp.owner_residual, held[1])


def check_zero_form(ps) -> None:
    """ZeRO: phase 1 only; the owner keeps the exact sum of its shard."""
    p, rank = ps.dp_size, ps.dp_rank
    comp = MomentumTopKCompressor(ratio=0.02, beta1=BETA1)
    comp.loss_scale = lambda: SCALE
    hand = ByHand(p)
    comp.prepare_step(1, 0, 0.0)
    grads = [rank_grad(r, 9) for r in range(p)]
    _, phase1, _ = hand.step(grads, 0.02, 0.0)
    out = torch.empty(hand.m)
    with record_comm(ps) as events:
        comp.reduce_scatter_(grads[rank] * SCALE / p, ps.dp_group, out)
    assert [e.op for e in events] == ["all_to_all"]
    torch.testing.assert_close(out, phase1[rank], rtol=1e-5, atol=1e-6)


def check_optimizers(ps) -> None:
    """After W = 2 AdamW steps the velocity is seeded from exp_avg, exp_avg becomes the exchanged
    sum, v stays frozen and w moves by lr * S / (1 - b1^t) / (sqrt(v) + eps); ZeRO-1 and ZeRO-2
    agree bit for bit and every replica holds the same parameters."""
    lr, betas, eps, warm = 0.01, (0.9, 0.99), 1e-8, 2
    policy = {"default": {"compressor": "topk", "ratio": 0.05}, "warmup_steps": warm,
              "variance_refresh": "off", "sparsity_warmup_steps": 2}
    finals = []
    for stage in (0, 1, 2):
        model = Linear(N)
        reducer = GradReducer(model, ps, compression_policy=policy)
        reducer.loss_scaler = SimpleNamespace(scale=1.0)
        cls = DistributedOptimizer if stage else MixedPrecisionOptimizer
        opt = cls([("w", model.w)], reducer, ps, lr=lr, betas=betas, eps=eps,
                  **({"zero_stage": stage} if stage else {}))
        comp = reducer.buckets[0].compressor
        assert isinstance(comp, MomentumTopKCompressor) and comp.beta1 == betas[0]
        for step in range(1, 7):
            opt.zero_grad()
            reducer.set_last_microbatch(True)
            model(rank_grad(ps.dp_rank, step)).backward()
            m_before = full_state(ps, opt, stage, "exp_avg", N)
            reducer.finish()
            if step > warm:
                assert comp.density == ramp_density(0.05, step - warm, 2)
            before = model.w.detach().clone()
            v = full_state(ps, opt, stage, "exp_avg_sq", N)
            if step == warm + 1:
                v = v / (1 - betas[1] ** warm)           # frozen, bias-corrected
                torch.testing.assert_close(comp._previous[:N], m_before)   # seeded from m
            opt.step(lr)
            if stage:
                opt.finish_param_gather()
            if step > warm:
                S = full_state(ps, opt, stage, "exp_avg", N)
                torch.testing.assert_close(full_state(ps, opt, stage, "exp_avg_sq", N), v)
                delta = -lr * S / (1 - betas[0] ** step) / (v.sqrt() + eps)
                torch.testing.assert_close(model.w.detach() - before, delta, rtol=1e-4, atol=1e-7)
                shard = reducer.buckets[0].numel // ps.dp_size       # (the bucket is padded)
                k = math.ceil(comp.density * shard)                   # per shard and sender
                # ZeRO: the exact sum of p senders' k; else the owners' 2 k
                assert 0 < int((S != 0).sum()) <= k * ps.dp_size * (ps.dp_size if stage else OWNER_FACTOR)
            assert all(torch.equal(o, model.w.detach())
                       for o in gather_tensors(ps.dp_group, model.w.detach()))
        finals.append(model.w.detach().clone())
        reducer.remove_hooks()
    assert torch.equal(finals[1], finals[2])


def check_skipped_step_is_no_step(ps) -> None:
    """A step whose gradient is not finite, skipped by the real loss scaler's check, leaves no
    trace: the run with it ends bit for bit where the run without it does, under no ZeRO and
    ZeRO-2. The residuals then hold many steps' unsent values, which a skip must not drop (it
    zeroed them once; the runs then differ)."""
    from engine.training.loss_scaler import DynamicLossScaler, unscale_and_check
    lr, steps, bad = 0.01, 6, 4
    policy = {"default": {"compressor": "topk", "ratio": 0.02}, "warmup_steps": 1,
              "variance_refresh": "off", "sparsity_warmup_steps": 0}
    for stage in (0, 2):
        finals = []
        for skip in (False, True):
            model = Linear(N)
            reducer = GradReducer(model, ps, compression_policy=policy)
            # hysteresis 2: one overflow keeps the scale, so both runs see the same scale
            scaler = DynamicLossScaler(init_scale=SCALE, growth_interval=1000, hysteresis=2)
            reducer.loss_scaler = scaler
            cls = DistributedOptimizer if stage else MixedPrecisionOptimizer
            opt = cls([("w", model.w)], reducer, ps, lr=lr,
                      **({"zero_stage": stage} if stage else {}))
            batches = [rank_grad(ps.dp_rank, step) for step in range(1, steps + 1)]
            if skip:
                batches.insert(bad, torch.full((N,), float("nan") if ps.dp_rank else 1.0))
            pending = []
            for c in batches:
                opt.zero_grad()
                reducer.set_last_microbatch(True)
                (model(c) * scaler.scale).backward()
                reducer.finish()
                check = unscale_and_check(opt, scaler, reducer=reducer)
                if check.skipped:
                    opt.skipped_step()
                    continue
                opt.step(lr)
                if stage:
                    opt.finish_param_gather()
                pending.append(float(reducer.buckets[0].compressor.residual.abs().sum()))
            assert reducer.step == steps + 1 and scaler.scale == SCALE     # (1-based)
            assert min(pending[1:]) > 0                      # the residuals held values back
            finals.append((model.w.detach().clone(), full_state(ps, opt, stage, "exp_avg", N)))
            reducer.remove_hooks()
        assert torch.equal(finals[0][0], finals[1][0]) and torch.equal(finals[0][1], finals[1][1])


def all_checks(ps) -> bool:
    check_exchange(ps)
    check_zero_form(ps)
    check_optimizers(ps)
    check_skipped_step_is_no_step(ps)
    return True


@pytest.mark.parametrize("dp", [2, 4])
def test_momentum_topk_on_gloo(dp):
    assert all(run_distributed(all_checks, grid=RankGrid(dp=dp)))


def test_sparsity_warmup_schedule():
    assert ramp_density(0.01, 1, 30) == 0.25
    assert ramp_density(0.01, 16, 30) == pytest.approx(0.05)
    assert ramp_density(0.01, 31, 30) == 0.01 and ramp_density(0.01, 5, 0) == 0.01
    assert ramp_density(0.5, 1, 30) == 0.5                 # denser than the start: no ramp
    assert CompressionPolicy.uniform("topk", train_iters=600).sparsity_warmup_steps == 120
    assert CompressionPolicy.uniform("topk", train_iters=600,
                                     sparsity_warmup_steps=0).sparsity_warmup_steps == 0
    assert CompressionPolicy.uniform("int8", train_iters=600).sparsity_warmup_steps == 0
    assert CompressionPolicy.from_dict({"default": "topk", "sparsity_warmup_steps": 12}) \
        .sparsity_warmup_steps == 12
    masked = CompressionPolicy.from_dict({"default": {"compressor": "topk", "momentum_masking": True}})
    assert masked.default.build().masking and not CompressionPolicy.uniform("topk").default.build().masking
    with pytest.raises(PolicyError, match="momentum_masking"):
        CompressionPolicy.from_dict({"default": {"compressor": "int8", "momentum_masking": True}})
