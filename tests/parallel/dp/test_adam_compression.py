"""Frozen-variance Adam for top-k buckets: after the warm-up the update is linear in the
compressed gradient stream, so error feedback is exact in the parameters themselves; the second
moment changes only at its refreshes, to the DP average of the ranks' local squared gradients.

The model is linear (loss_r = <w, c_r(t)>), so every gradient is known in advance whatever the
parameters: with beta1 = 0 and no weight decay, w after T steps plus what the residuals still hold
(scaled like an update) must equal w after the warm-up minus the sum of all true mean gradients.
With Adam's second moment fed by the compressed stream (bursts) that identity fails.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from parallel.dp import DistributedOptimizer, GradReducer, MixedPrecisionOptimizer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import gather_tensors, run_distributed

N, LR, EPS, BETA2 = 4096, 0.01, 1e-12, 0.9


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp_w = nn.Parameter(torch.zeros(N))

    def forward(self, c):
        return (self.mlp_w * c).sum()


def grad_of(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(N, generator=g) * torch.logspace(-2, 1, N)[torch.randperm(N, generator=g)]


def run(ps, stage: int, steps: int, refresh: int, warmup: int = 2, loss_scale: float = 1.0):
    model = Linear()
    policy = {"default": {"compressor": "topk", "ratio": 0.05}, "warmup_steps": warmup,
              "variance_refresh": refresh}
    reducer = GradReducer(model, ps, compression_policy=policy)
    reducer.loss_scaler = SimpleNamespace(scale=loss_scale)
    cls = DistributedOptimizer if stage else MixedPrecisionOptimizer
    kw = {"zero_stage": stage} if stage else {}
    opt = cls([("mlp_w", model.mlp_w)], reducer, ps, lr=LR, betas=(0.0, BETA2), eps=EPS, **kw)
    history = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        reducer.set_last_microbatch(True)
        (model(grad_of(ps.dp_rank, step)) * loss_scale).backward()
        reducer.finish()
        if loss_scale != 1.0:
            opt.unscale_(1.0 / loss_scale)
        opt.step(LR)
        if stage:
            opt.finish_param_gather()
        history.append((model.mlp_w.detach().clone(), full_variance(ps, opt, stage)))
    return model, opt, reducer, history


def full_variance(ps, opt, stage) -> torch.Tensor:
    if not stage:
        return opt.inner.state[opt.masters[0]]["exp_avg_sq"].clone()
    return torch.cat(gather_tensors(ps.dp_group, opt.exp_avg_sq))[:N]


def mean_grad(ps, step: int) -> torch.Tensor:
    return torch.stack([grad_of(r, step) for r in range(ps.dp_size)]).mean(0)


def check_linear_error_feedback(ps) -> None:
    steps, warmup = 9, 2
    for stage in (0, 1, 2):
        model, opt, reducer, history = run(ps, stage, steps, refresh=0, warmup=warmup)
        bucket = reducer.buckets[0]
        assert opt.variance_frozen and bucket.compressed_step
        w_warm = history[warmup - 1][0]
        v_frozen = history[warmup][1]       # the warm-up's v, stored bias-corrected from then on
        d = v_frozen.sqrt() + EPS
        for w, v in history[warmup:]:
            assert torch.equal(v, v_frozen), stage                    # frozen: never updated
        held = bucket.compressor.residual.clone()[:N]
        ps.dp_group.all_reduce(held)
        if bucket.compressor.owner_residual is not None:
            held += torch.cat(gather_tensors(ps.dp_group, bucket.compressor.owner_residual))[:N]
        truth = sum(mean_grad(ps, t) for t in range(warmup + 1, steps + 1))
        got = model.mlp_w.detach() - LR * held / d       # (what is held back moves it later)
        want = w_warm - LR * truth / d
        assert (LR * held / d).abs().max() > 0.05                        # it held a lot back
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"stage {stage}")
        # the warm-up's second moment, bias-corrected: exactly AdamW's from the exact gradients
        v = torch.zeros(N)
        for t in range(1, warmup + 1):
            v = BETA2 * v + (1 - BETA2) * mean_grad(ps, t) ** 2
        torch.testing.assert_close(v_frozen, v / (1 - BETA2 ** warmup), rtol=1e-5, atol=0)


def check_refresh(ps) -> None:
    steps, warmup, refresh = 8, 2, 3                  # set at step 3, refreshed at 5 and 8
    for stage in (0, 2):
        _, _, reducer, history = run(ps, stage, steps, refresh, warmup)
        assert [reducer.refresh_due(t) for t in range(1, steps + 1)] == \
            [False, False, True, False, True, False, False, True]
        vs = [v for _, v in history]
        assert torch.equal(vs[2], vs[3]) and torch.equal(vs[5], vs[6])   # frozen between refreshes
        assert not torch.equal(vs[3], vs[4]) and not torch.equal(vs[6], vs[7])
        for at in (3, 5, 8):   # the DP mean of each rank's EMA of its own squared gradient
            local = []
            for r in range(ps.dp_size):
                sq = torch.zeros(N)
                for t in range(1, at + 1):
                    sq = BETA2 * sq + (1 - BETA2) * grad_of(r, t) ** 2
                local.append(sq / (1 - BETA2 ** at))
            want = torch.stack(local).mean(0)
            rel = (vs[at - 1] - want).abs() / want
            assert rel.max() < 0.12, (stage, at, rel.max())
        # under a loss scale (a power of two: every value scales exactly) the refreshed variance is
        # the same, in the optimizer's unscaled units
        _, _, _, scaled = run(ps, stage, steps, refresh, warmup, loss_scale=1024.0)
        for (_, v), (_, u) in zip(history, scaled):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=0)


def all_checks(ps) -> bool:
    check_linear_error_feedback(ps)
    check_refresh(ps)
    return True


@pytest.mark.parametrize("dp", [2])
def test_frozen_variance_on_gloo(dp):
    assert all(run_distributed(all_checks, grid=RankGrid(dp=dp)))


def test_single_rank_keeps_plain_adamw():
    """dp=1 exchanges nothing, so nothing is compressed and AdamW stays AdamW."""
    from parallel.grid.state import ParallelState
    ps = ParallelState.serial()
    model, opt, reducer, history = run(ps, 0, 4, refresh=0)
    ref = Linear()
    adam = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.0, BETA2), eps=EPS, weight_decay=0.0)
    for step in range(1, 5):
        adam.zero_grad()
        ref(grad_of(0, step)).backward()
        adam.step()
    assert not reducer.compressed and not opt.variance_frozen
    torch.testing.assert_close(model.mlp_w, ref.mlp_w, rtol=1e-6, atol=1e-7)
