"""Loss scaling, global gradient norm over TP x PP, and the world-wide overflow skip, on gloo."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine.training.loss_scaler import ConstantScaler, DynamicLossScaler, unscale_and_check
from parallel.dp import MixedPrecisionOptimizer
from parallel.grads.norm import clip_grads, found_inf, global_grad_norm
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed


def logical_grads() -> dict[str, torch.Tensor]:
    """Gradients of the serial model: a tied embedding, two TP-split weights, two replicated vectors."""
    g = torch.Generator().manual_seed(7)
    shapes = {"embed": (6, 4), "w1": (8, 4), "b1": (4,), "w2": (4, 8), "ln": (4,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def local_params(ps: ParallelState, dtype=torch.float32) -> list[nn.Parameter]:
    """This rank's pieces: stage 0 holds embed, w1 (rows split), b1; stage 1 holds the embedding
    copy, w2 (columns split), ln. Grads are set to the matching slice of the logical gradient."""
    grads, t = logical_grads(), ps.tp_rank
    def make(name, grad, sharded=False, **marks):
        p = nn.Parameter(torch.zeros(grad.shape, dtype=dtype))
        p.grad = grad.clone().to(dtype)
        p.tp_sharded = sharded
        for k, v in marks.items():
            setattr(p, k, v)
        return p
    embed = make("embed", grads["embed"].chunk(2, 0)[t], sharded=True)
    if ps.pp_rank == 0:
        return [embed, make("w1", grads["w1"].chunk(2, 0)[t], True), make("b1", grads["b1"])]
    embed.shared_embedding = True
    return [embed, make("w2", grads["w2"].chunk(2, 1)[t], True),
            make("ln", grads["ln"], sequence_parallel=True)]


def reference_norm() -> float:
    return math.sqrt(sum(float(g.pow(2).sum()) for g in logical_grads().values()))


def grid_checks(ps: ParallelState) -> dict:
    ref = reference_norm()
    params = local_params(ps)
    norm = global_grad_norm(params, ps)
    assert norm == pytest.approx(ref, rel=1e-6)
    before = [p.grad.clone() for p in params]
    assert clip_grads(params, ref / 2, ps) == pytest.approx(ref, rel=1e-6)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g * (ref / 2) / (ref + 1e-6))
    assert global_grad_norm(params, ps) == pytest.approx(ref / 2, rel=1e-5)
    assert not found_inf(params, ps)
    if ps.rank == 3:
        params[1].grad[0, 0] = float("inf")
    assert found_inf(params, ps)                                  # on every rank

    # fp16 training with dynamic scaling: an overflow on one rank skips the step everywhere
    params = local_params(ps, torch.float16)
    opt = MixedPrecisionOptimizer(params, ps=ps, lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=2, growth_interval=1000)
    history = []
    for step in range(3):
        scale = scaler.scale
        for p, g in zip(params, local_params(ps, torch.float32)):
            p.grad = (g.grad * scale).to(torch.float16)
        if step > 0 and ps.rank == 3:
            params[-1].grad[0] = float("inf")
        start = [p.detach().clone() for p in params]
        check = unscale_and_check(opt, scaler, clip_grad=0.0)
        if check.skipped:
            assert check.grad_norm is None
        else:
            assert check.grad_norm == pytest.approx(ref, rel=1e-3)   # unscaled, fp16 gradients
            opt.step(0.1)
        changed = any(not torch.equal(a, p) for a, p in zip(start, params))
        assert changed != check.skipped
        history.append((check.skipped, scaler.scale))
    return {"history": history}


def test_grad_norm_clip_and_overflow_skip_on_tp_pp_grid():
    results = run_distributed(grid_checks, grid=RankGrid(tp=2, pp=2))
    # step 0 clean; step 1 overflow (hysteresis absorbs it); step 2 overflow -> back off
    expected = [(False, 1024.0), (True, 1024.0), (True, 512.0)]
    assert all(r["history"] == expected for r in results)


def test_dynamic_scaler_growth_backoff_hysteresis_and_floor():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    assert [s.update(False) for _ in range(3)] == [False] * 3 and s.scale == 16.0
    assert s.update(True) and s.scale == 16.0          # first overflow: tolerated, still skipped
    assert s.update(True) and s.scale == 8.0           # second: back off
    assert s.update(True) and s.scale == 4.0           # tracker exhausted: each overflow backs off
    state = s.state_dict()
    t = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    t.load_state_dict(state)
    assert t.state_dict() == state
    assert s.update(True) and s.update(True) and s.scale == 2.0   # floor at min_scale
    assert [s.update(False) for _ in range(3)] == [False] * 3 and s.scale == 4.0
    assert s.update(True) and s.scale == 4.0           # growth restored the hysteresis


@pytest.mark.parametrize("kwargs, word", [({"init_scale": 0}, "init_scale"),
                                          ({"growth_factor": 1.0}, "growth_factor"),
                                          ({"backoff_factor": 1.0}, "backoff_factor"),
                                          ({"growth_interval": 0}, "growth_interval"),
                                          ({"hysteresis": 0}, "hysteresis"),
                                          ({"min_scale": 4096.0}, "min_scale")])
def test_dynamic_scaler_rejects_bad_settings(kwargs, word):
    with pytest.raises(ValueError, match=word):
        DynamicLossScaler(**kwargs)


class _Residuals:
    def __init__(self):
        self.calls = []

    def step_skipped(self):
        self.calls.append("skipped")

    def step_applied(self):
        self.calls.append("applied")

    def rescale_residuals(self, factor):
        self.calls.append(factor)


def test_constant_scaler_and_serial_unscale_and_check():
    ps = ParallelState.serial()
    assert ConstantScaler().update(True) and not ConstantScaler().update(False)
    p = nn.Parameter(torch.zeros(3))
    opt = MixedPrecisionOptimizer([p], ps=ps)
    scaler, residuals = DynamicLossScaler(init_scale=4.0, growth_interval=1), _Residuals()
    p.grad = torch.tensor([12.0, 16.0, 0.0])
    check = unscale_and_check(opt, scaler, clip_grad=1.0, reducer=residuals)
    assert not check.skipped and check.loss_scale == 4.0 and check.grad_norm == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8, 0.0]) / (1 + 2e-7), rtol=1e-6, atol=0)
    assert scaler.scale == 8.0 and residuals.calls == ["applied", 2.0]
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert unscale_and_check(opt, scaler, reducer=residuals).skipped      # hysteresis: no backoff
    assert scaler.scale == 8.0 and residuals.calls[2:] == ["skipped"]
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    assert unscale_and_check(opt, scaler, reducer=residuals).skipped
    # the residuals put back are in the units of the scale before the backoff
    assert scaler.scale == 4.0 and residuals.calls[3:] == ["skipped", 0.5]
