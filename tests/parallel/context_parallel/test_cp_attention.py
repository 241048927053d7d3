"""Context-parallel attention (parallel/context_parallel) against full attention, on real gloo ranks.

- Sharding arithmetic: the worked examples of sharding.py, every token on exactly one rank, the
  load-balanced shard's causal work equal on every rank; sequence shards of AttentionInputs and
  micro-batches keep global positions and cut segments where the shard jumps.
- Ring attention (cp = 2 and 4) and Ulysses (cp = 2, and cp = 4 with repeated key/value heads):
  each rank's output and the gradients of its q, k, v shards equal full attention's on those
  tokens, causal and with packed documents of uneven lengths that cross shard boundaries, with
  grouped-query attention; the ring on both CPU block paths (ATen's kernel and the tiled plain math).
- Communication: the ring sends K/V cp-1 times forward and K/V cp-1 plus dK/dV cp times backward,
  only to its ring neighbours on the CP group, with the exact payload; Ulysses four all-to-alls each
  way.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

import kernels
from engine.data.packing import MicroBatch
from models.batch import AttentionInputs
from parallel.runtime.comm import CommGroup
from parallel.context_parallel import (chunk_ids, context_parallel_attention, shard_index,
                                       shard_positions, ulysses_kv_repeat)
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import record_comm, run_distributed
from tests.helpers.stream_check import stream_checked

TOL = dict(atol=3e-5, rtol=3e-5)


# ---- pure arithmetic ------------------------------------------------------------------------

def test_worked_examples():
    assert shard_index(8, 2, 0) == [0, 1, 6, 7] and shard_index(8, 2, 1) == [2, 3, 4, 5]
    assert shard_index(8, 2, 0, balanced=False) == [0, 1, 2, 3]
    assert shard_index(8, 2, 1, balanced=False) == [4, 5, 6, 7]
    assert shard_index(16, 4, 1) == [2, 3, 12, 13] and chunk_ids(4, 1) == (1, 6)
    assert shard_index(5, 1, 0) == list(range(5))
    assert shard_positions(4, 2, 1, True).tolist() == [2, 3, 4, 5]
    assert ulysses_kv_repeat(2, 4) == 2 and ulysses_kv_repeat(4, 2) == 1 and ulysses_kv_repeat(3, 4) == 4


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_every_token_on_one_rank_and_balanced_work(cp, balanced):
    s = 4 * cp * 3
    shards = [shard_index(s, cp, r, balanced) for r in range(cp)]
    assert sorted(i for sh in shards for i in sh) == list(range(s))
    assert all(sh == sorted(sh) for sh in shards)
    assert all(shard_positions(s // cp, cp, r, balanced).tolist() == sh for r, sh in enumerate(shards))
    if balanced:  # causal work of a rank: keys at or before each of its queries
        work = {sum(i + 1 for i in sh) for sh in shards}
        assert len(work) == 1


def test_unshardable_lengths_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_index(12, 4, 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_index(10, 4, 0, balanced=False)


def test_shards_of_metadata_and_micro_batches():
    """Row [a a a E | b b E c] (E = 9) over cp=2: rank 0 holds tokens 0 1 6 7."""
    tokens = torch.tensor([[1, 2, 3, 9, 4, 5, 9, 6]])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    inputs = AttentionInputs(pos, docs, (0, 4, 7, 8))
    idx = torch.tensor(shard_index(8, 2, 0))
    shard = inputs.select(idx)
    assert shard.position_ids.tolist() == [[0, 1, 2, 0]]  # global positions kept
    assert shard.document_ids.tolist() == [[0, 0, 1, 2]]
    assert shard.cu_seqlens == (0, 2, 3, 4) and shard.whole is inputs
    doc_jump = AttentionInputs(pos, torch.zeros(1, 8, dtype=torch.int32), (0, 8)).select(idx)
    assert doc_jump.cu_seqlens == (0, 2, 4)  # one document, two pieces: the shard jumps 1 -> 6
    assert inputs.select(idx).select(torch.tensor([0, 1])).whole is inputs
    mb = MicroBatch(tokens, tokens + 1, inputs, (tokens != 9).float(), 11).select(idx)
    assert mb.tokens.tolist() == [[1, 2, 9, 6]] and mb.labels.tolist() == [[2, 3, 10, 7]]
    assert mb.loss_mask.tolist() == [[1, 1, 0, 1]] and mb.loss_tokens == 11
    assert mb.inputs.whole is inputs


# ---- multi-rank: ring and Ulysses against full attention -----------------------------------------

def _documents(b, s, seed):
    """(b, s) int32 ids of uneven documents (lengths 1..s/2, the first row a long one in the
    middle) that cross shard boundaries."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in range(b):
        lengths, left = [], s
        while left:
            n = min(left, int(torch.randint(1, s // 2 + 1, (1,), generator=gen)))
            if row == 0 and not lengths:
                n = 3
            elif row == 0 and len(lengths) == 1:
                n = min(left, s - 5)
            lengths.append(n)
            left -= n
        rows.append(torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                            torch.tensor(lengths)))
    return torch.stack(rows)


def _case(b, n, g, s, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, s, d, generator=gen)
    k, v = (torch.randn(b, g, s, d, generator=gen) for _ in range(2))
    up = torch.randn(b, n, s, d, generator=gen)
    return q, k, v, up


def _full(q, k, v, up, docs):
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernels.attention_reference(*xs, causal=True, document_ids=docs)
    return [out.detach(), *torch.autograd.grad(out, xs, up)]


def _sharded(group, comm_type, q, k, v, up, docs):
    idx = torch.tensor(shard_index(q.shape[2], group.size, group.rank, comm_type == "p2p"))
    xs = [t.index_select(2, idx).clone().requires_grad_(True) for t in (q, k, v)]
    cu = kernels.cu_seqlens_from_document_ids(docs) if docs is not None else None
    out = context_parallel_attention(*xs, group, comm_type, document_ids=docs, cu_seqlens=cu)
    return idx, [out.detach(), *torch.autograd.grad(out, xs, up.index_select(2, idx))]


def _compare(ps, group, label, comm_type, b, n, g, s, d, seed, packed):
    q, k, v, up = _case(b, n, g, s, d, seed)
    docs = _documents(b, s, seed) if packed else None
    want = _full(q, k, v, up, docs)
    idx, got = _sharded(group, comm_type, q, k, v, up, docs)
    errors = []
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        w = w.index_select(2, idx)
        if not torch.allclose(a, w, **TOL):
            errors.append(f"{label}: {name} differs by {(a - w).abs().max():.3g}")
    return errors


def _pairs(ps) -> CommGroup:
    """CP groups of two ([0, 1], [2, 3]) on a 4-rank job, created on every rank alike."""
    mine = None
    for ranks in ([0, 1], [2, 3]):
        pg = dist.new_group(ranks)
        if ps.rank in ranks:
            mine = CommGroup("cp", tuple(ranks), ranks.index(ps.rank), pg, ps.comm)
    return mine


def check_against_full_attention(ps):
    lse_mod = importlib.import_module("kernels.attention_lse")
    groups = {2: _pairs(ps), 4: ps.cp_group}
    errors = []
    for cp, group in groups.items():
        s = 8 * cp
        for packed in (False, True):
            for comm_type, g in (("p2p", 2), ("p2p", 4), ("a2a", 2), ("a2a", 4)):
                label = f"cp={cp} {comm_type} G={g} {'packed' if packed else 'causal'}"
                errors += _compare(ps, group, label, comm_type, 2, 4, g, s, 8, 10 * cp + g, packed)
        aten = lse_mod._aten_cpu_ops
        lse_mod._aten_cpu_ops = lambda: None  # the tiled plain-math block path
        try:
            errors += _compare(ps, group, f"cp={cp} p2p blockwise packed", "p2p", 1, 4, 1, s, 8, 3, True)
        finally:
            lse_mod._aten_cpu_ops = aten
    return errors


def record_ring_and_ulysses(ps):
    cp = ps.cp_group
    b, n, g, s, d = 1, 4, 2, 32, 8
    q, k, v, up = _case(b, n, g, s, d, 1)
    out = {}
    for comm_type in ("p2p", "a2a"):
        idx = torch.tensor(shard_index(s, cp.size, cp.rank, comm_type == "p2p"))
        xs = [t.index_select(2, idx).requires_grad_(True) for t in (q, k, v)]
        with record_comm(ps) as fwd:
            y = context_parallel_attention(*xs, cp, comm_type)
        with record_comm(ps) as bwd:
            y.backward(up.index_select(2, idx))
        out[comm_type] = [[(e.op, e.group, e.payload_bytes, e.ranks) for e in events]
                          for events in (fwd, bwd)]
    return out


def both_checks(ps):
    # the ring's transfers and their waits, forward and backward, under the stream-order checker
    return check_against_full_attention(ps), stream_checked(ps, record_ring_and_ulysses)


@pytest.fixture(scope="module")
def four_ranks():
    """One spawned group of 4 ranks for every multi-rank check here (start-up costs seconds)."""
    return run_distributed(both_checks, grid=RankGrid(cp=4))


def test_ring_and_ulysses_equal_full_attention(four_ranks):
    errors = [e for per_rank, _ in four_ranks for e in per_rank]
    assert not errors, "\n".join(errors)


def test_ring_and_ulysses_communication(four_ranks):
    results = [comm for _, comm in four_ranks]
    cp, kv_bytes = 4, 2 * 1 * 2 * 8 * 8 * 4  # k and v: (2, b, n_kv, s/cp, d) fp32
    for rank, per_rank in enumerate(results):
        fwd, bwd = per_rank["p2p"]
        assert [e[0] for e in fwd] == ["send", "recv"] * (cp - 1)
        assert all(e[1] == "cp" and e[3] == (0, 1, 2, 3) for e in fwd + bwd)
        assert sum(e[2] for e in fwd) == (cp - 1) * kv_bytes
        sends = [e for e in bwd if e[0] == "send"]
        assert len(sends) == (cp - 1) + cp  # K/V cp-1 times, their dK/dV accumulators cp times
        assert sum(e[2] for e in sends) == (2 * cp - 1) * kv_bytes
        fwd, bwd = per_rank["a2a"]
        assert [e[0] for e in fwd] == ["all_to_all"] * 4 and [e[0] for e in bwd] == ["all_to_all"] * 4
        # q, k and v (k, v repeated to 4 heads, which cp = 4 then splits), and the output
        assert sum(e[2] for e in fwd) == (4 + 4 + 4 + 4) * 8 * 8 * 4
