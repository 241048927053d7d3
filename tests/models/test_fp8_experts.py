"""The experts' FP8 scales over the logical tensor (kernels/fp8_grouped.py, models/moe/experts.py)
on a real tp=2 gloo group, against the serial FP8 experts, exactly.

- Expert tensor parallelism: ``LocalExperts`` (gelu, with biases) whole, and on each rank its
  slice of every expert (fc1's output rows, fc2's input columns) as under ``--etp 2``, both set
  to FP8 by ``set_fp8``. Every scale a rank uses is the serial
  experts' (or its slice of them): fc2's per-token scales of its input and its weight-row scales
  run over the split features and are MAX-reduced over ETP, fc1's input-gradient scales likewise;
  the rest are computed whole where they are. Outputs and gradients equal the serial experts'
  within bf16 rounding (fc2's partial sums are added over the ranks). Each forward reduces once,
  fc1's backward once, on the TP group, counted as TP traffic, in the sizes engine/plan/fp8.py
  counts.
- Token groups (sequence parallelism without ETP, CP at ep 1): each rank holds half of the rows of
  every (expert, source) segment; the weight gradients' column scales, reduced over the group, are
  the serial ones over all the rows, exactly.
- EP with CP (``SegmentSlots``): a micro-batch's rows of an expert arrive as several segments, on
  one rank and on the expert's replica; each takes the serial scales of the whole micro-batch.
"""
from __future__ import annotations

import torch

from kernels.fp8 import Fp8Recipe
from kernels.fp8_grouped import Fp8GroupedBackward, Fp8GroupedForward, GroupedFp8Spec, SegmentSlots
from models.config import GPTConfig
from models.layers import LayerContext
from models.logical import logical_views
from models.moe.experts import LocalExperts
from parallel.grid.topology import RankGrid
from parallel.tensor_parallel import Initializer
from parallel.tensor_parallel.fp8 import set_fp8
from tests.helpers.dist_utils import run_distributed

RECIPE = Fp8Recipe("hybrid")
COUNTS, SEGMENTS = [7, 0, 12], [3, 4, 0, 0, 12, 0]   # 3 experts, 2 sources each
H, F = 64, 32
BF16_ULP = 2.0 ** -8


def _full(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _ends(counts) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


class Scales:
    """The Fp8GroupedForward / Fp8GroupedBackward objects built while entered, in order."""

    def __enter__(self):
        self.made, self._inits = [], (Fp8GroupedForward.__init__, Fp8GroupedBackward.__init__)
        made, (fwd, bwd) = self.made, self._inits

        def record(init):
            def wrapped(obj, *args, **kwargs):
                init(obj, *args, **kwargs)
                made.append(obj)
            return wrapped
        Fp8GroupedForward.__init__, Fp8GroupedBackward.__init__ = record(fwd), record(bwd)
        return self

    def __exit__(self, *exc):
        Fp8GroupedForward.__init__, Fp8GroupedBackward.__init__ = self._inits


def _experts(etp=(0, 1), group=None) -> LocalExperts:
    """Experts 1..3 of 4 (gelu, with biases) in bf16, whole or this ETP rank's slice of each, with
    the same logical tensors (random, biases nonzero) on every rank, in FP8."""
    cfg = GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=4,
                    vocab_size=16, num_experts=4, moe_ffn_hidden_size=F)
    ctx = LayerContext(Initializer(3, cfg.init_std))
    whole = LocalExperts(cfg, ctx, "e", "gelu", True, range(1, 4))
    experts = LocalExperts(cfg, ctx, "e", "gelu", True, range(1, 4), etp, group)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(std=0.1, generator=torch.Generator().manual_seed(p.numel()))
        full = logical_views(whole)
        for p in experts.parameters():
            for lp in p.logical_parts:
                src = full[lp.name]
                lp.view(p).copy_(src if lp.shard_dim is None else src.chunk(etp[1], lp.shard_dim)[etp[0]])
    experts.to(torch.bfloat16)
    set_fp8(experts, RECIPE)
    return experts


def _run(experts: LocalExperts, x, dy):
    x = x.detach().clone().requires_grad_()
    with Scales() as rec:
        y = experts(x, _ends(COUNTS), None, _ends(SEGMENTS))
        y.backward(dy)
    grads = [x.grad] + [p.grad for p in (experts.fc1_weight, experts.fc1_bias, experts.fc2_weight)]
    return y.detach(), grads, rec.made


SCALES = {"forward": ("x_scale", "w_scale"), "backward": ("g_rows", "w_cols", "g_cols", "x_cols")}


def _scales(obj) -> dict:
    names = SCALES["forward" if isinstance(obj, Fp8GroupedForward) else "backward"]
    return {n: getattr(obj, n) for n in names}


def _close(got, want, what, ulps=2.0):
    err = (got.float() - want.float()).abs().max()
    assert err <= ulps * BF16_ULP * want.float().abs().max() + 1e-6, (what, err.item())


def _check_etp(ps) -> dict:
    tp, r = ps.tp_group, ps.tp_rank
    n = sum(COUNTS)
    x, dy = _full(1, n, H, scale=2.0), _full(2, n, H, scale=1e-2)
    serial = _run(_experts(), x, dy)
    before = ps.comm.snapshot()
    y, grads, made = _run(_experts((r, 2), tp), x, dy)
    traffic = ps.comm.since(before).get("tp", {})
    # made: fc1 forward, fc2 forward, fc2 backward, fc1 backward (autograd's order); the scales
    # along this rank's slice of f: (dim of the scale, which is cut)
    cut = {("fc1 forward", "w_scale"): 1, ("fc2 backward", "w_cols"): 2,
           ("fc2 backward", "x_cols"): 1, ("fc1 backward", "g_cols"): 1}
    assert len(made) == 4
    for what, mine, whole in zip(("fc1 forward", "fc2 forward", "fc2 backward", "fc1 backward"),
                                 made, serial[2]):
        for name, value in _scales(mine).items():
            want = _scales(whole)[name]
            if (what, name) in cut:
                want = want.chunk(2, cut[(what, name)])[r]
            assert torch.equal(value, want), (what, name)
    total, dx = y.float(), grads[0].float()
    tp.all_reduce(total)                                  # fc2's partial sums over the slices
    tp.all_reduce(dx)                                     # fc1's input gradient likewise
    _close(total, serial[0], "y")
    _close(dx, serial[1][0], "dx")
    _close(grads[1], serial[1][1].chunk(2, 1)[r], "dW_in")
    _close(grads[2], serial[1][2].chunk(2, 1)[r], "db_in")
    _close(grads[3], serial[1][3].chunk(2, 2)[r], "dW_out")
    return {"calls": traffic.get("calls"), "bytes": traffic.get("payload_bytes"),
            "want": 4 * 2 * (n + 3 * H)}


def _check_tokens(ps) -> None:
    tp, r = ps.tp_group, ps.tp_rank
    n = sum(SEGMENTS)
    x, dy = _full(5, n, H, scale=2.0), _full(6, n, F, scale=1e-2)
    w = _full(7, 3, F, H, scale=0.1)
    whole = Fp8GroupedBackward(GroupedFp8Spec(RECIPE), dy, x, w, _ends(COUNTS), _ends(SEGMENTS))
    # this rank's half of every segment's rows, still sorted by segment
    ends = _ends(SEGMENTS).tolist()
    mine, counts = [], []
    for lo, hi in zip([0] + ends[:-1], ends):
        half = (hi - lo + 1 - r) // 2
        start = lo + (hi - lo + 1) // 2 * r
        mine.append(torch.arange(start, start + half))
        counts.append(half)
    take = torch.cat(mine)
    groups = [sum(counts[i:i + 2]) for i in range(0, len(counts), 2)]
    part = Fp8GroupedBackward(GroupedFp8Spec(RECIPE, token_groups=(tp,)), dy[take], x[take], w,
                              _ends(groups), _ends(counts))
    assert torch.equal(part.g_cols, whole.g_cols) and torch.equal(part.x_cols, whole.x_cols)
    alone = Fp8GroupedBackward(GroupedFp8Spec(RECIPE), dy[take], x[take], w, _ends(groups),
                               _ends(counts))
    assert not torch.equal(alone.g_cols, whole.g_cols)   # the reduction is what makes them equal


# EP x CP: rank r's rows per (local expert, source), three sources at DP x CP positions 3 r ..
# 3 r + 2 with cp 2: micro-batches (0, 0, 1) on rank 0 and (1, 2, 2) on rank 1
SLOT_COUNTS = [[[2, 3, 1], [0, 4, 2], [3, 0, 0]],
               [[1, 2, 2], [2, 0, 3], [0, 1, 5]]]


def _check_slots(ps) -> None:
    """Under EP with CP the segments of one micro-batch (on this rank, and on the other: the
    expert's replica over EDP, played by the TP group) take the serial run's column scales of
    that micro-batch's rows of the expert, exactly."""
    group, r = ps.tp_group, ps.tp_rank
    mb = lambda rank, j: (3 * rank + j) // 2                        # noqa: E731
    blocks = {}                                   # (rank, expert, source) -> its rows' indices
    at = 0
    for rank, table in enumerate(SLOT_COUNTS):
        for g, counts in enumerate(table):
            for j, c in enumerate(counts):
                blocks[rank, g, j] = torch.arange(at, at + c)
                at += c
    x, dy, w = _full(8, at, H, scale=2.0), _full(9, at, F, scale=1e-2), _full(10, 3, F, H, scale=0.1)
    # the serial run: one segment per (expert, micro-batch), every rank's rows of it
    order, counts = [], []
    for g in range(3):
        for m in range(3):
            rows = [blocks[k] for k in sorted(blocks) if k[1] == g and mb(k[0], k[2]) == m]
            order.append(torch.cat(rows))
            counts.append(sum(len(t) for t in rows))
    take = torch.cat(order)
    groups = [sum(counts[i:i + 3]) for i in range(0, 9, 3)]
    whole = Fp8GroupedBackward(GroupedFp8Spec(RECIPE), dy[take], x[take], w, _ends(groups),
                               _ends(counts))
    mine = torch.cat([blocks[r, g, j] for g in range(3) for j in range(3)])
    seg = [c for table in SLOT_COUNTS[r] for c in table]
    offsets = _ends([sum(t) for t in SLOT_COUNTS[r]])
    slots = SegmentSlots(first=3 * r, sources=3, stride=2, slots=3, group=group)
    part = Fp8GroupedBackward(GroupedFp8Spec(RECIPE, slots=slots), dy[mine], x[mine], w, offsets,
                              _ends(seg))
    want = [g * 3 + mb(r, j) for g in range(3) for j in range(3)]
    assert slots.index(9, "cpu").tolist() == want
    assert torch.equal(part.g_cols, whole.g_cols[want]) and torch.equal(part.x_cols, whole.x_cols[want])
    alone = Fp8GroupedBackward(GroupedFp8Spec(RECIPE), dy[mine], x[mine], w, offsets, _ends(seg))
    assert not torch.equal(alone.g_cols, whole.g_cols[want])   # the merge is what makes them equal


def _case(ps):
    out = _check_etp(ps)
    _check_tokens(ps)
    _check_slots(ps)
    return out


def test_expert_scales_are_the_serial_scales_over_etp_and_token_groups():
    for got in run_distributed(_case, grid=RankGrid(tp=2)):
        assert got["calls"] == 2 and got["bytes"] == got["want"], got
