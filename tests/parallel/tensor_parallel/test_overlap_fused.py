"""The Ascend MC2 path of --tp-comm-overlap (parallel/tensor_parallel/overlap_fused.py
``NpuMc2Path``), run on a real 2-rank gloo TP group through a stand-in for torch_npu's three fused
ops. The stand-in implements each op's documented formula and input rules (op-plugin 7.3.0:
fp16/bf16, 2-D x2 (k, n), k in [256, 65535), 2-D x1 for the gather/scatter ops and 2-D or 3-D for
the all-reduce, gather and scatter along dim 0, world size equal to the communicator's) with real
collectives on the group; what is under test is the path's argument preparation: the rank-major
layout of (b, s, h) activations around the gather and scatter ops, the weight transposes, the
bias kept out of the fused all-reduce, and the fallbacks outside the documented limits.

- all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce against the plain collectives and
  GEMMs (bf16, k = 256);
- the row-parallel layer without sequence parallelism through the fused all-reduce
  (``_MatmulAllReduceForwardIdentityBackward``): output, input and weight gradients equal the
  plain layer's;
- outside the documented limits (fp32; k < 256, as a backward's k may be) the gather + GEMM and the
  GEMM + reduce-scatter take the chunked ring (``ring_pass``, point-to-point batches, no
  all-gather or reduce-scatter), never the stand-in, and give the plain collectives' and GEMMs'
  results (the gathered input too); the GEMM + all-reduce falls back to the plain ops (no ring
  exists for it); on the CPU the layers never take a fused path;
- the TP sizes are the chip table's decision: every size ``TP_OVERLAP_OPS`` lists (A3's 16 and
  32 too) passes the path's per-call check, and the fused all-reduce's only A2's.

The CUDA path (``SymmMemPath``) the same way, through a stand-in for PyTorch's two
symmetric-memory ops (``fused_all_gather_matmul``: A gathered along ``gather_dim`` and A @ B for
every B; ``fused_matmul_reduce_scatter``: A @ B reduce-scattered along ``scatter_dim``): the
column-parallel pair and the row-parallel layer under sequence parallelism with the fused path
equal the plain layers, forward and backward. And the start-up probe's agreement (``agree``):
when one rank's rendezvous fails, every rank runs the ring and the line names that rank.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from parallel.tensor_parallel import (ColumnParallelLinear, Initializer, RowParallelLinear,
                                      set_tp_comm_overlap)
from parallel.tensor_parallel import overlap, overlap_fused, ring
from parallel.tensor_parallel.mappings import _gather
from engine.device.chips import TP_OVERLAP_ALL_REDUCE, TP_OVERLAP_OPS
from parallel.tensor_parallel.overlap import _MatmulAllReduceForwardIdentityBackward
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

HCOM = "hcom-tp"
K = 256


class FakeMc2:
    """torch_npu's MC2 ops on one group: the documented formulas and input rules."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def _check(self, x1, x2, hcom, dims=(2,)):
        assert hcom == HCOM, hcom
        assert x1.dtype in (torch.float16, torch.bfloat16) and x2.dtype == x1.dtype, (x1.dtype, x2.dtype)
        assert x1.dim() in dims and x2.dim() == 2, (x1.shape, x2.shape)
        assert x1.shape[-1] == x2.shape[0] and 256 <= x2.shape[0] < 65535, (x1.shape, x2.shape)

    def _pg(self):
        return self.group.process_group

    def npu_all_gather_base_mm(self, x1, x2, hcom, world_size, gather_output=True):
        self._check(x1, x2, hcom)
        assert world_size == self.group.size
        self.calls.append("all_gather_base_mm")
        parts = [torch.empty_like(x1, dtype=torch.float32) for _ in range(world_size)]
        dist.all_gather(parts, x1.float(), group=self._pg())
        gathered = torch.cat(parts)                                  # (n m, k), rank-major
        out = (gathered @ x2.float()).to(x1.dtype)
        return out, (gathered.to(x1.dtype) if gather_output else None)

    def npu_mm_reduce_scatter_base(self, x1, x2, hcom, world_size, reduce_op="sum"):
        self._check(x1, x2, hcom)
        assert reduce_op == "sum" and world_size == self.group.size
        assert x1.shape[0] % world_size == 0, x1.shape
        self.calls.append("mm_reduce_scatter_base")
        y = x1.float() @ x2.float()
        dist.all_reduce(y, group=self._pg())
        return y.chunk(world_size)[self.group.rank].to(x1.dtype).contiguous()

    def npu_mm_all_reduce_base(self, x1, x2, hcom, reduce_op="sum", bias=None):
        self._check(x1, x2, hcom, dims=(2, 3))
        assert reduce_op == "sum"
        self.calls.append("mm_all_reduce_base")
        y = x1.float() @ x2.float() + (0 if bias is None else bias.float())
        dist.all_reduce(y, group=self._pg())
        return y.to(x1.dtype)


def _rand(seed: int, *shape, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def fused_group(ps) -> dict:
    group, r = ps.tp_group, ps.tp_rank
    fake = FakeMc2(group)
    saved = (overlap_fused.import_torch_npu, overlap_fused.npu_all_reduce_op,
             overlap_fused.NpuMc2Path._hcom)
    overlap_fused.import_torch_npu = lambda: fake
    overlap_fused.npu_all_reduce_op = lambda: True
    overlap_fused.NpuMc2Path._hcom = staticmethod(lambda g: HCOM)
    path, out = overlap_fused.NPU_MC2, {}
    try:
        # all-gather + GEMM: shard (b, s/n, k), two weights (k, o_i)
        shard = _rand(10 + r, 2, 3, K)
        ws = [_rand(20, K, 8, scale=0.05), _rand(21, K, 4, scale=0.05)]
        gathered, outs = path.all_gather_matmul(shard, ws, group, gather=True)
        full = _gather(shard.float(), 1, group)                          # (b, s, k)
        out["ag_gathered"] = (gathered.float() - full).abs().max().item()
        out["ag_outs"] = max((o.float() - (full @ w.float())).abs().max().item() for o, w in zip(outs, ws))
        out["ag_shapes"] = [tuple(o.shape) for o in outs]
        # GEMM + reduce-scatter: a (b, s, k) per rank -> chunk r of the sum, (b, s/n, o)
        a, w = _rand(30 + r, 2, 6, K), _rand(40, K, 8, scale=0.05)
        got = path.matmul_reduce_scatter(a, w, group).float()
        total = a.float() @ w.float()
        dist.all_reduce(total, group=group.process_group)
        out["rs"] = (got - total.chunk(2, dim=1)[r]).abs().max().item()
        out["rs_shape"] = tuple(got.shape)
        # GEMM + all-reduce (no sequence parallelism)
        got = path.matmul_all_reduce(a, w, group).float()
        out["ar"] = (got - total).abs().max().item()
        out["fused_calls"] = list(fake.calls)
        # outside the documented limits (fp32; k = 128): the gather + GEMM and the GEMM +
        # reduce-scatter on the chunked ring (the real ring_pass, watched), the stand-in
        # untouched; the GEMM + all-reduce on the plain ops
        fake.calls.clear()
        real_ring, real_batch = ring.ring_pass, group.batch_isend_irecv   # the path's ring_pass
        rings, batches = [], []

        def ring_spy(g, shard=None, on_chunk=None, partial=None):
            rings.append(("gather" if shard is not None else "") + ("scatter" if partial else ""))
            return real_ring(g, shard, on_chunk=on_chunk, partial=partial)

        def batch_spy(transfers):
            batches.append(sorted(kind for kind, _, _ in transfers))
            return real_batch(transfers)
        overlap_fused.ring_pass, group.batch_isend_irecv = ring_spy, batch_spy
        a32, w32 = a.float(), w.float()
        ws32 = [v.float() for v in ws]
        try:
            # fp32 gather + GEMMs, gathered input returned
            gathered, outs = path.all_gather_matmul(shard.float(), ws32, group, gather=True)
            out["fb_ag32_gathered"] = (gathered - full).abs().max().item()
            out["fb_ag32"] = max((o - full @ v).abs().max().item() for o, v in zip(outs, ws32))
            out["fb_ag32_shapes"] = [tuple(o.shape) for o in outs]
            # bf16, k = 128: gather + GEMMs, no gathered input
            none, outs = path.all_gather_matmul(shard[..., :128], [v[:128] for v in ws], group)
            plain_ag = _gather(shard[..., :128], 1, group)
            out["fb_ag128_none"] = none is None
            out["fb_ag128"] = max((o.float() - (plain_ag @ v[:128]).float()).abs().max().item()
                                  for o, v in zip(outs, ws))
            out["fb_ag128_shapes"] = [tuple(o.shape) for o in outs]
            # fp32 GEMM + reduce-scatter; bf16, k = 128
            got = path.matmul_reduce_scatter(a32, w32, group)
            out["fb_rs32"] = (got - total.chunk(2, dim=1)[r]).abs().max().item()
            small = path.matmul_reduce_scatter(a[..., :128], w[:128], group)
            total128 = a[..., :128].float() @ w[:128].float()
            dist.all_reduce(total128, group=group.process_group)
            out["fb_rs128"] = (small.float() - total128.chunk(2, dim=1)[r]).abs().max().item()
            out["fb_rs128_shape"] = (tuple(small.shape), small.dtype)
            out["fb_rings"] = list(rings)
            # the GEMM + all-reduce: no ring, the plain GEMM and all-reduce
            rings.clear()
            plain = path.matmul_all_reduce(a32, w32, group)
            out["fb_ar_rings"] = list(rings)
        finally:
            overlap_fused.ring_pass = real_ring
            del group.batch_isend_irecv
        out["fb_batches"] = batches
        out["fallback_calls"] = list(fake.calls)
        out["fallback_ar"] = (plain - total).abs().max().item()
        # the row-parallel layer's fused GEMM + all-reduce, forward and backward, against the
        # plain layer (the same weights, bf16)
        fake.calls.clear()
        layer = RowParallelLinear(2 * K, 8, ps, "row", Initializer(seed=5, std=0.05), bias=True)
        layer = layer.to(torch.bfloat16)
        with torch.no_grad():
            layer.bias.copy_(_rand(60, 8))
        x = _rand(70 + r, 2, 6, K).requires_grad_()
        dy = _rand(80, 2, 6, 8)
        y_plain = layer(x)
        (y_plain * dy).sum().backward()
        ref = (y_plain.detach().float(), x.grad.float(), layer.weight.grad.float())
        x.grad, layer.weight.grad, layer.bias.grad = None, None, None
        y = _MatmulAllReduceForwardIdentityBackward.apply(x, layer.weight, group, None, path) + layer.bias
        (y * dy).sum().backward()
        out["layer"] = [(t.float() - u).abs().max().item()
                        for t, u in zip((y.detach(), x.grad, layer.weight.grad), ref)]
        out["layer_calls"] = list(fake.calls)
    finally:
        (overlap_fused.import_torch_npu, overlap_fused.npu_all_reduce_op) = saved[:2]
        overlap_fused.NpuMc2Path._hcom = saved[2]
    # on the CPU no fused path is taken: --tp-comm-overlap without SP leaves the layer plain
    layer = RowParallelLinear(16, 8, ps, "cpu_row", Initializer(seed=5, std=0.5), bias=True)
    x = _rand(90 + r, 2, 4, 8, dtype=torch.float32)
    before = layer(x)
    set_tp_comm_overlap(layer, "auto")
    out["cpu_same"] = torch.equal(layer(x), before)
    out["cpu_path"] = overlap_fused.fused_path(x, group)
    return out


class FakeSymmMem:
    """PyTorch's symmetric-memory fused ops on one group: their documented results."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def fused_all_gather_matmul(self, a_shard, bs, gather_dim, group_name, return_A=True):
        assert group_name == "tp-name" and gather_dim == 1, (group_name, gather_dim)
        self.calls.append("fused_all_gather_matmul")
        a = _gather(a_shard, gather_dim, self.group)
        return (a if return_A else None), [a @ b for b in bs]

    def fused_matmul_reduce_scatter(self, a, b, reduce_op, scatter_dim, group_name):
        assert group_name == "tp-name" and scatter_dim == 1 and reduce_op == "sum"
        self.calls.append("fused_matmul_reduce_scatter")
        y = a @ b
        dist.all_reduce(y, group=self.group.process_group)
        return y.chunk(self.group.size, dim=scatter_dim)[self.group.rank].contiguous()


class _Named:
    group_name = "tp-name"


def symm_mem_group(ps) -> dict:
    """The column-parallel pair and the row-parallel layer under SP through SymmMemPath (the
    stand-in), against the same layers with the plain collectives (fp32)."""
    group, r = ps.tp_group, ps.tp_rank
    fake = FakeSymmMem(group)
    saved = (overlap_fused.symm_mem_namespace, overlap_fused.fused_path, overlap_fused._pg)
    saved_layers = overlap.fused_path
    out = {}
    try:
        overlap_fused.symm_mem_namespace = lambda: fake
        overlap_fused._pg = lambda g: _Named()
        path = overlap_fused.SYMM_MEM
        shard = _rand(11 + r, 2, 3, 16, dtype=torch.float32)
        ws = [_rand(12, 16, 8, dtype=torch.float32), _rand(13, 16, 4, dtype=torch.float32)]
        gathered, outs = path.all_gather_matmul(shard, ws, group, gather=True)
        full = _gather(shard, 1, group)
        out["ag"] = max([(gathered - full).abs().max().item()] +
                        [(o - full @ w).abs().max().item() for o, w in zip(outs, ws)])
        a, w = _rand(14 + r, 2, 6, 16, dtype=torch.float32), _rand(15, 16, 8, dtype=torch.float32)
        total = a @ w
        dist.all_reduce(total, group=group.process_group)
        out["rs"] = (path.matmul_reduce_scatter(a, w, group) - total.chunk(2, dim=1)[r]).abs().max().item()
        out["calls"] = list(fake.calls)
        # the layers under sequence parallelism through the fused path, forward and backward,
        # against the plain layers with the same weights
        overlap.fused_path = lambda t, g, mode="auto": path
        col = ColumnParallelLinear(16, 8, ps, "col", Initializer(seed=7, std=0.5), bias=True,
                                   sequence_parallel=True)
        row = RowParallelLinear(8, 16, ps, "row", Initializer(seed=8, std=0.5), bias=True,
                                sequence_parallel=True)
        x = _rand(16 + r, 2, 3, 16, dtype=torch.float32).requires_grad_()
        results = []
        for mode in (None, "auto"):
            set_tp_comm_overlap([col, row], mode)
            x.grad = None
            for p in (*col.parameters(), *row.parameters()):
                p.grad = None
            y = row(col(x))                                   # (b, s/tp, h)
            (y * _rand(17 + r, *y.shape, dtype=torch.float32)).sum().backward()
            results.append([y.detach(), x.grad, col.weight.grad, row.weight.grad])
        out["layers"] = max((a - b).abs().max().item() for a, b in zip(*results))
        out["layer_calls"] = fake.calls[2:]
    finally:
        overlap.fused_path = saved_layers
        overlap_fused.symm_mem_namespace, overlap_fused.fused_path, overlap_fused._pg = saved
    # the start-up probe: one rank failing its rendezvous puts every rank on the ring
    def fails_on_rank_1():
        if r == 1:
            raise RuntimeError("peer access is not supported between these devices\nmore")
    out["agree_ok"] = overlap_fused.agree(group, lambda: None, "auto")
    out["agree_failed"] = overlap_fused.agree(group, fails_on_rank_1, "auto")
    out["probe_cpu"] = overlap_fused.probe_mode(group, "cpu", "auto")
    return out


def test_symm_mem_path_and_the_start_up_probe():
    for r in run_distributed(symm_mem_group, grid=RankGrid(tp=2)):
        assert r["ag"] < 1e-5 and r["rs"] < 1e-5, r
        assert r["calls"] == ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]
        assert r["layers"] < 1e-5, r["layers"]
        # forward: gather + GEMM (column), GEMM + scatter (row); backward: the row's gather +
        # GEMM, then the column's GEMM + scatter
        assert r["layer_calls"] == ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"] * 2
        assert r["agree_ok"] == ("auto", None)
        assert r["agree_failed"] == ("ring", "--tp-comm-overlap: the TP group's devices cannot "
                                     "share symmetric memory (rank 1: peer access is not supported "
                                     "between these devices); the chunked ring overlaps the TP "
                                     "communication instead")
        assert r["probe_cpu"] == ("auto", None)       # nothing to probe on the CPU


def test_npu_mc2_path_prepares_the_documented_operands():
    for r in run_distributed(fused_group, grid=RankGrid(tp=2)):
        assert r["ag_gathered"] == 0.0
        assert r["ag_outs"] < 3e-2 and r["ag_shapes"] == [(2, 6, 8), (2, 6, 4)], r
        assert r["rs"] < 3e-2 and r["rs_shape"] == (2, 3, 8), r
        assert r["ar"] < 3e-2, r
        assert r["fused_calls"] == ["all_gather_base_mm", "mm_reduce_scatter_base", "mm_all_reduce_base"]
        # outside the limits: the ring (each of its four calls one point-to-point batch of a
        # send and a receive on 2 ranks), never the stand-in, the plain ops' results
        assert r["fallback_calls"] == [], r["fallback_calls"]
        assert r["fb_rings"] == ["gather", "gather", "scatter", "scatter"], r["fb_rings"]
        assert r["fb_batches"] == [["recv", "send"]] * 4, r["fb_batches"]
        assert r["fb_ag32_gathered"] == 0.0 and r["fb_ag32"] < 1e-5, r
        assert r["fb_ag32_shapes"] == [(2, 6, 8), (2, 6, 4)], r
        assert r["fb_ag128_none"] and r["fb_ag128"] < 1e-2, r
        assert r["fb_ag128_shapes"] == [(2, 6, 8), (2, 6, 4)], r
        assert r["fb_rs32"] < 1e-5 and r["fb_rs128"] < 3e-2, r
        assert r["fb_rs128_shape"] == ((2, 3, 8), torch.bfloat16), r
        assert r["fb_ar_rings"] == [] and r["fallback_ar"] < 1e-4, r
        assert max(r["layer"]) < 5e-2, r["layer"]
        assert r["layer_calls"] == ["mm_all_reduce_base"]
        assert r["cpu_same"] and r["cpu_path"] is None


def test_npu_mc2_group_sizes_are_the_chip_tables():
    """The path's per-call check leaves the TP size to the chip table: every size a generation
    documents for the gather/scatter pair (A3's 16 and 32 included) passes it, and the fused
    all-reduce's bound is A2's; dtype and k are still checked."""
    x = torch.zeros(1, dtype=torch.bfloat16)
    ok = overlap_fused.NpuMc2Path._ok
    sizes = {n for op in TP_OVERLAP_OPS.values() for ns in op.values() for n in ns}
    assert {16, 32} <= sizes
    for n in sorted(sizes):
        assert ok(x, K, SimpleNamespace(size=n)), n
    for n in (1, 3, 64):
        assert not ok(x, K, SimpleNamespace(size=n)), n
    assert not ok(x.float(), K, SimpleNamespace(size=16))
    assert not ok(x, 128, SimpleNamespace(size=16))
    all_reduce = overlap_fused.NPU_ALL_REDUCE_WORLD_SIZES
    for n in TP_OVERLAP_ALL_REDUCE["npu_mm_all_reduce_base"]["atlas-a2"]:
        assert ok(x, K, SimpleNamespace(size=n), all_reduce), n
    assert not ok(x, K, SimpleNamespace(size=16), all_reduce)


class _MatmulOnOneRank:
    """The fused matmul + all-reduce on a group of one: the matmul (the MC2 op runs on NPUs only)."""

    def matmul_all_reduce(self, a, b, group):
        return a.matmul(b)


def test_fused_row_gemm_defers_its_weight_gradient_under_full_recompute():
    """Under --recompute full (non-reentrant checkpoint) and a zero-bubble W split, the deferred
    weight gradient reaches the Parameter's main_grad and the reducer is told of the Parameter
    itself, as without recomputation (a saved weight would come back as a detached copy)."""
    from torch.utils.checkpoint import checkpoint
    from parallel.grads.weight_grad import WeightGradStore
    grads = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
        w.main_grad = torch.zeros_like(w)
        ready = []
        store = WeightGradStore(on_ready=ready.append)
        x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)

        def f(t):
            return _MatmulAllReduceForwardIdentityBackward.apply(t * 1.0, w, None, store,
                                                                 _MatmulOnOneRank())
        y = checkpoint(f, x, use_reentrant=False) if recompute else f(x)   # (2, 5, 3)
        with store.capture("mb0"):
            y.sum().backward()
        store.run("mb0")
        assert len(ready) == 1 and ready[0] is w
        # dW = dy^T x with dy all ones
        torch.testing.assert_close(w.main_grad, torch.ones(10, 3, dtype=torch.float64).t()
                                   @ x.detach().reshape(10, 4))
        grads[recompute] = w.main_grad.clone()
    assert torch.equal(grads[True], grads[False])
