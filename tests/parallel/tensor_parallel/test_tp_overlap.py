"""--tp-comm-overlap (parallel/tensor_parallel/overlap.py, ring.py): the overlapped column- and
row-parallel layers against the plain sequence-parallel ones on real gloo groups of 2 and 4 ranks,
fp32, forward and backward: outputs, input gradients and parameter gradients within 1e-6, with
the weight gradients computed in backward and deferred to a zero-bubble W action. Every rank runs
under the stream-order checker (tests/helpers/stream_check.py) and the suite's HCCL rules; the
overlapped layers must move their data as point-to-point chunks (no all-gather or reduce-scatter
collective, but the column W's one all-gather), the plain ones as collectives. Without --sequence-parallel the flag
is refused before any collective.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import (ColumnParallelLinear, Initializer, RowParallelLinear,
                                      set_tp_comm_overlap)
from parallel.tensor_parallel.layers import column_parallel_linears
from parallel.grid.topology import RankGrid
from parallel.grads.weight_grad import WeightGradStore, attach_weight_grad_store
from tests.helpers.dist_utils import run_distributed
from tests.helpers.stream_check import stream_checked
from tests.parallel.tensor_parallel.test_tp_mappings import tp_states

TOL = dict(rtol=1e-6, atol=1e-6)
INIT = Initializer(seed=3, std=0.5)


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ops(ps: ParallelState, fn) -> list[str]:
    """The TP communication ops ``fn()`` issues, in order."""
    seen: list[str] = []

    def watch(event):
        if event.group == "tp":
            seen.append(event.op)
    ps.comm.observers.append(watch)
    try:
        fn()
    finally:
        ps.comm.observers.remove(watch)
    return seen


def _column(ps, overlap, pair: bool, bias: bool):
    """One column-parallel layer, or two reading one input (SwiGLU's gate and up)."""
    names = ("gate", "up") if pair else ("col",)
    mods = torch.nn.ModuleList(ColumnParallelLinear(16, 24, ps, n, INIT, bias=bias,
                                                    sequence_parallel=True) for n in names)
    with torch.no_grad():
        for i, m in enumerate(mods):
            if m.bias is not None:
                m.bias.copy_(_full(50 + i, 24).chunk(ps.tp_size)[ps.tp_rank])
    set_tp_comm_overlap(mods, "ring" if overlap else None)
    return mods


def _row(ps, overlap, bias: bool):
    mod = RowParallelLinear(24, 16, ps, "row", INIT, bias=bias, sequence_parallel=True)
    if mod.bias is not None:
        with torch.no_grad():
            mod.bias.copy_(_full(60, 16))
    set_tp_comm_overlap(mod, "ring" if overlap else None)
    return mod


def _run(ps, mods, kind: str, deferred: bool, b=2, s=8):
    """Forward and backward of one layer pattern; returns (ops, output, input grad, param grads)."""
    n, r = ps.tp_size, ps.tp_rank
    store = WeightGradStore() if deferred else None
    attach_weight_grad_store(list(mods) if kind == "column" else [mods], store)
    if kind == "column":
        x = _full(1, b, s, 16).chunk(n, dim=1)[r].clone().requires_grad_(True)  # (b, s/tp, h)
        weights = [_full(2 + i, b, s, 24).chunk(n, dim=-1)[r] for i in range(len(mods))]
    else:
        x = _full(3, b, s, 24).chunk(n, dim=-1)[r].clone().requires_grad_(True)  # (b, s, in/tp)
        weights = [_full(4, b, s, 16).chunk(n, dim=1)[r]]
    out = {}

    def step():
        ys = column_parallel_linears(list(mods), x) if kind == "column" else [mods(x)]
        loss = sum((y * w).sum() for y, w in zip(ys, weights))
        if deferred:
            with store.capture("mb0"):
                loss.backward()
            assert all(p.grad is None for p in mods.parameters() if p.dim() == 2), \
                "a weight gradient was computed in B"
            assert store.run("mb0") > 0
        else:
            loss.backward()
        out["y"] = torch.cat([y.detach() for y in ys], dim=-1)
    ops = _ops(ps, step)
    grads = {name: p.grad.clone() for name, p in mods.named_parameters()}
    return ops, out["y"], x.grad.clone(), grads


def _compare(ps, kind: str, make) -> None:
    for deferred in (False, True):
        plain = _run(ps, make(False), kind, deferred)
        ovl = _run(ps, make(True), kind, deferred)
        what = f"tp={ps.tp_size} {kind} deferred={deferred}"
        assert set(plain[0]) <= {"all_gather", "reduce_scatter"} and plain[0], (what, plain[0])
        ring = [op for op in ovl[0] if op in ("send", "recv")]
        assert ring and set(ovl[0]) - {"send", "recv"} == (   # chunks on the ring, except the
            {"all_gather"} if deferred and kind == "column" else set()), (what, ovl[0])  # W's gather
        torch.testing.assert_close(ovl[1], plain[1], **TOL, msg=lambda m: f"{what} output: {m}")
        torch.testing.assert_close(ovl[2], plain[2], **TOL, msg=lambda m: f"{what} input grad: {m}")
        assert ovl[3].keys() == plain[3].keys()
        for name in plain[3]:
            torch.testing.assert_close(ovl[3][name], plain[3][name], **TOL,
                                       msg=lambda m: f"{what} {name} grad: {m}")


def _check(ps: ParallelState) -> str:
    for sub in tp_states(ps).values():
        for pair in (False, True):
            _compare(sub, "column", lambda o, pair=pair: _column(sub, o, pair, bias=not pair))
        _compare(sub, "row", lambda o: _row(sub, o, bias=True))
    return "ok"


def test_overlapped_layers_equal_plain_tp2_tp4_under_the_stream_checker():
    assert run_distributed(stream_checked, grid=RankGrid(tp=4), args=(_check,)) == ["ok"] * 4


def test_without_sequence_parallel_the_flag_fails_before_any_collective(monkeypatch):
    def no_collectives(*args, **kwargs):
        raise AssertionError("the process group was started before the configuration was checked")

    monkeypatch.setattr(ParallelState, "initialize", no_collectives)
    argv = ["--mock-data", "--vocab-size", "256", "--device", "cpu", "--no-progress", "--tp", "2",
            "--tp-comm-overlap"]
    with pytest.raises((ConfigError, ValueError), match=r"--tp-comm-overlap needs --sequence-parallel"):
        Trainer(parse_args(argv), launch=LaunchEnv(0, 2, 0, 2))
    assert not dist.is_initialized()
