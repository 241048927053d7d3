"""Backend rules and the communication layer's counters.

- Pure: the HCCL and NCCL tables refuse what those backends refuse (float64 reductions and
  ``gather`` on HCCL, int16 on NCCL, AVG on HCCL, complex anywhere, tensors inside object
  collectives) and accept what they accept; ``resolve`` picks the rules from the backend and chip.
- On gloo (which accepts all of it): a planted float64 all-reduce fails under HCCL rules on every
  rank before anything is sent, and passes with no rules, so it is the rules that bite; the payload
  and ring-model bytes of every collective are counted per group kind from the tensors passed.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel.runtime.backend_rules import (BackendRuleError, check, check_batch, check_object,
                                            get_rules, resolve)
from parallel.runtime.comm_monitor import wire_bytes
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

HCCL, HCCL950, NCCL = get_rules("hccl"), get_rules("hccl:950"), get_rules("nccl")


def t(dtype):
    return torch.zeros(4, dtype=dtype)


@pytest.mark.parametrize("rules, op, dtype, ok", [
    (HCCL, "all_reduce", torch.float64, False),        # torch_npu: "HCCL AllReduce: Unsupported data type"
    (HCCL, "reduce_scatter", torch.float64, False),
    (HCCL, "all_reduce", torch.float32, True),
    (HCCL, "all_reduce", torch.bfloat16, True),
    (HCCL, "all_reduce", torch.int64, True),
    (HCCL, "all_reduce", torch.bool, False),
    (HCCL, "all_reduce", torch.uint8, False),
    (HCCL, "all_gather", torch.float64, True),         # HcclAllGather moves float64
    (HCCL, "all_gather", torch.uint8, True),
    (HCCL, "send", torch.float64, True),
    (HCCL950, "all_reduce", torch.float64, True),      # Ascend 950 reduces float64
    (NCCL, "all_reduce", torch.int16, False),          # no ncclInt16
    (NCCL, "all_gather", torch.int16, False),
    (NCCL, "all_reduce", torch.float64, True),
    (NCCL, "all_to_all", torch.uint8, True),
])
def test_dtype_table(rules, op, dtype, ok):
    if ok:
        check(rules, op, "dp", [t(dtype)])
    else:
        with pytest.raises(BackendRuleError, match=str(dtype)[6:]):
            check(rules, op, "dp", [t(dtype)])


def test_ops_complex_objects_and_resolve():
    with pytest.raises(BackendRuleError, match="does not implement gather"):
        check(HCCL, "gather", "world")
    check(NCCL, "gather", "world")
    with pytest.raises(BackendRuleError, match="reduce op 'avg'"):
        check(HCCL, "all_reduce", "dp", [t(torch.float32)], dist.ReduceOp.AVG)
    check(NCCL, "all_reduce", "dp", [t(torch.float32)], dist.ReduceOp.AVG)
    with pytest.raises(BackendRuleError, match="prod on torch.bfloat16"):
        check(HCCL, "all_reduce", "dp", [t(torch.bfloat16)], dist.ReduceOp.PRODUCT)
    for rules in (HCCL, NCCL):
        with pytest.raises(BackendRuleError, match="complex"):
            check(rules, "all_gather", "tp", [t(torch.complex64)])
        with pytest.raises(BackendRuleError, match="carries a tensor"):
            check_object(rules, "all_gather_object", "world", {"a": [1, {"b": torch.ones(2)}]})
        check_object(rules, "all_gather_object", "world", {"a": [1, 2.0, "x"]})
    check(None, "all_reduce", "dp", [t(torch.float64)])           # no rules: anything goes
    # HcclBatchSendRecv: one send to and one receive from each peer per call (NCCL: any number)
    one_each = [("send", t(torch.float32), 1), ("recv", t(torch.float32), 1),
                ("send", t(torch.float32), 3)]
    check_batch(HCCL, "pp", one_each)
    for kind, way in (("send", "sends to"), ("recv", "receives from")):
        with pytest.raises(BackendRuleError, match=f"{way} rank 1 twice: HcclBatchSendRecv"):
            check_batch(HCCL, "pp", one_each + [(kind, t(torch.float32), 1)])
        check_batch(NCCL, "pp", one_each + [(kind, t(torch.float32), 1)])
    assert resolve("auto", "gloo") is None
    assert resolve("auto", "nccl", "NVIDIA H200") == "nccl"
    assert resolve("auto", "hccl", "Ascend910B2") == "hccl"
    assert resolve("auto", "hccl", "Ascend950PR") == "hccl:950"
    assert resolve("hccl", "gloo") == "hccl" and resolve("none", "nccl") is None
    with pytest.raises(ValueError, match="unknown backend rules"):
        resolve("mpi", "gloo")


def _planted(ps, rules_name):
    """A float64 all-reduce (what the step statistics once sent) under the given rules."""
    x = torch.ones(3, dtype=torch.float64)
    try:
        ps.world_group.all_reduce(x)
    except BackendRuleError as exc:
        ps.world_group.all_reduce(torch.ones(1))     # every rank refused; the group is still usable
        return f"refused: {exc}"
    return f"sent: {x.tolist()}"


def _counts(ps):
    """Payload and wire bytes per op and group kind, from the tensors handed over."""
    n, r = ps.world_size, ps.rank
    before = ps.comm.snapshot()
    g = ps.dp_group
    g.all_reduce(torch.ones(8))                                           # 32 bytes
    out = torch.empty(n * 8)
    g.all_gather_into(out, torch.full((8,), float(r)))                    # own shard: 32 bytes
    gathered = out.view(n, 8)[:, 0].tolist()
    shard = torch.empty(2)
    g.reduce_scatter_into(shard, torch.ones(2 * n))                       # 8n bytes
    recv = torch.empty(n, dtype=torch.int32)
    g.all_to_all_single(recv, torch.full((n,), r, dtype=torch.int32))     # 4n bytes
    b = torch.full((5,), float(r))
    g.broadcast(b, src=0)                                                 # 20 bytes on the source
    peer = (r + 1) % n
    back = torch.empty(3, dtype=torch.bfloat16)
    for w in ps.pp_group.batch_isend_irecv([]):                           # (pp=1: nothing)
        w.wait()
    for w in g.batch_isend_irecv([("send", torch.ones(3, dtype=torch.bfloat16), peer),
                                  ("recv", back, (r - 1) % n)]):
        w.wait()
    return {"since": ps.comm.since(before), "gathered": gathered, "shard": shard.tolist(),
            "recv": recv.tolist(), "b": b.tolist()}


def test_rules_bite_on_gloo_and_bytes_are_counted():
    refused = run_distributed(_planted, grid=RankGrid(dp=2), args=("hccl",), backend_rules="hccl")
    assert all(r.startswith("refused: hccl (Atlas A2/A3) refuses torch.float64 in all_reduce")
               for r in refused), refused
    sent = run_distributed(_planted, grid=RankGrid(dp=2), args=(None,), backend_rules=None)
    assert sent == ["sent: [2.0, 2.0, 2.0]"] * 2                 # gloo itself accepts float64

    n = 4
    results = run_distributed(_counts, grid=RankGrid(dp=n), backend_rules="hccl")
    for r, res in enumerate(results):
        assert res["gathered"] == [0.0, 1.0, 2.0, 3.0] and res["shard"] == [4.0, 4.0]
        assert res["recv"] == list(range(n)) and res["b"] == [0.0] * 5
        dp = res["since"]["dp"]
        payload = 32 + 32 + 8 * n + 4 * n + (20 if r == 0 else 0) + 6
        wire = (wire_bytes("all_reduce", 32, n) + wire_bytes("all_gather", 32, n)
                + wire_bytes("reduce_scatter", 8 * n, n) + wire_bytes("all_to_all", 4 * n, n)
                + wire_bytes("broadcast", 20 if r == 0 else 0, n) + 6)
        assert dp == {"calls": 7, "payload_bytes": payload, "wire_bytes": wire}, (r, dp)
        assert all(v["calls"] == 0 for k, v in res["since"].items() if k != "dp")


def test_an_allowed_signature_is_checked_once_and_a_refused_one_every_time():
    import dataclasses

    import torch.distributed as dist
    rules = dataclasses.replace(get_rules("hccl"), passed=set())
    t32 = torch.ones(4)
    check(rules, "all_reduce", "tp", [t32], reduce_op=dist.ReduceOp.SUM)
    check(rules, "all_reduce", "tp", [torch.zeros(9)], reduce_op=dist.ReduceOp.SUM)  # same signature
    assert rules.passed == {("all_reduce", "tp", (torch.float32,), dist.ReduceOp.SUM)}
    for _ in range(2):
        with pytest.raises(BackendRuleError, match="float64"):
            check(rules, "all_reduce", "tp", [t32.double()], reduce_op=dist.ReduceOp.SUM)
        with pytest.raises(BackendRuleError, match="avg"):
            check(rules, "all_reduce", "tp", [t32], reduce_op=dist.ReduceOp.AVG)
    assert len(rules.passed) == 1
