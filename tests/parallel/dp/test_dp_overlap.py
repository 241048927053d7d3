"""Overlap shown by the order of events on real gloo ranks, not by counting launches.

- Uncompressed buckets: a bucket's collective is issued while backward still has modules to go.
- Compressed buckets are exchanged from their gradient hooks on the side stream "dp-exchange" (no
  second host thread: every rank submits to its communicators in one order): their collectives
  are issued before backward reaches the first module of the model.
- ZeRO's parameter all-gathers: all issued at the end of the step, each waited for only in the
  forward pre-hook of the first unit (a child of the model, with its subtree) using it, after
  earlier units of the next forward ran;
  the overlapped run trains exactly like the synchronous one.
"""
from __future__ import annotations

import torch

from parallel.runtime import streams
from parallel.dp import DistributedOptimizer, GradReducer
from parallel.runtime.lanes import EXCHANGE_LANE, current_lane
from parallel.dp.param_gather import gather_units
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import record_comm, run_distributed
from tests.helpers.stream_check import stream_checked
from tests.parallel.dp.test_dp_reducer import backward_step, batch, groups, lr_at, make_model, serial_train

SMALL = 200 * 4 / 2 ** 20
POLICY = {"default": "none", "warmup_steps": 1, "rules": [
    {"pattern": "mlp*", "compressor": "topk", "ratio": 0.1},
    {"pattern": "attn*", "compressor": "int8"}]}


def log_backward(model, log) -> None:
    """("bwd", name) when a module's backward is done."""
    for name, module in model.named_children():
        module.register_full_backward_hook(lambda m, gi, go, name=name: log.append(("bwd", name)))


def log_forward(model, log) -> None:
    for name, module in model.named_modules():
        if name:
            module.register_forward_pre_hook(lambda m, a, name=name: log.append(("fwd", name)))


def check_uncompressed_order(ps) -> None:
    model = make_model()
    reducer = GradReducer(model, ps, bucket_size_mb=SMALL)
    log = []
    log_backward(model, log)
    with record_comm(ps) as events:
        events_log = events
        ps.comm.observers.append(lambda e: log.append(("comm", e.op)))
        reducer.zero_grad()
        reducer.set_last_microbatch(True)
        model(*batch(1)).backward()
        reducer.finish()
        ps.comm.observers.pop()
    first = log.index(("comm", "all_reduce"))
    assert ("bwd", "embed") in log[first:], log        # backward went on after the launch
    assert len([e for e in events_log if e.op == "all_reduce"]) == len(reducer.buckets)
    reducer.remove_hooks()


def check_compressed_overlap(ps) -> None:
    """A compressed bucket is exchanged from its gradient hook, on the side stream "dp-exchange"
    in the exchange lane: its collectives are issued while backward still has modules to go (on
    a device they run beside the rest of backward), and the compute stream waits for that stream
    only in ``finish()``."""
    model = make_model()
    reducer = GradReducer(model, ps, bucket_size_mb=SMALL, compression_policy=POLICY)
    assert reducer.buckets[0].compressor is None and any(b.compressor for b in reducer.buckets)
    backward_step(model, reducer, 1, ps.dp_size, ps.dp_rank, m=1)         # warm-up step
    log = []
    log_backward(model, log)

    def observe(event):
        log.append(("comm", event.op, streams.current_stream_name(), current_lane()))

    ps.comm.observers.append(observe)
    try:
        reducer.zero_grad()
        reducer.set_last_microbatch(True)
        model(*batch(2)).backward()
        log.append(("finish",))
        reducer.finish()
    finally:
        ps.comm.observers.remove(observe)
    a2a = next(i for i, e in enumerate(log) if e[:2] == ("comm", "all_to_all"))
    assert ("bwd", "embed") in log[a2a:]
    # every DP collective of the compressed step came from the side stream in the exchange
    # lane, during backward, in bucket order
    comm = [e for e in log if e[0] == "comm"]
    assert comm and all(e[2:] == ("dp-exchange", EXCHANGE_LANE) for e in comm), comm
    assert log.index(("finish",)) > max(i for i, e in enumerate(log) if e[0] == "comm")
    assert [b.compressed_step for b in reducer.buckets] == [b.compressor is not None for b in reducer.buckets]
    reducer.remove_hooks()


def train_zero(ps, overlap: bool, steps: int, stage: int, log=None):
    model = make_model()
    reducer = GradReducer(model, ps, bucket_size_mb=SMALL)
    opt = DistributedOptimizer(groups(model), reducer, ps, lr=0.0, betas=(0.9, 0.95),
                               zero_stage=stage, overlap_param_gather=overlap)
    opt.register_param_gather_hooks([model])
    if log is not None:
        log_forward(model, log)
        opt.param_gather.on_wait = lambda i: log.append(("wait", i))
        ps.comm.observers.append(lambda e: e.op == "all_gather" and log.append(("gather",)))
    for step in range(1, steps + 1):
        if log is not None:
            log.append(("step", step))
        opt.zero_grad()
        backward_step(model, reducer, step, ps.dp_size, ps.dp_rank, m=2)
        opt.clip_grad_norm(0.5)
        opt.step(lr_at(step))
    if log is not None:
        ps.comm.observers.pop()
    opt.finish_param_gather()
    return model, opt


def check_param_gather_overlap(ps) -> None:
    log = []
    model, opt = train_zero(ps, True, 3, stage=2, log=log)
    n = len(opt.reducer.buckets)
    second = log.index(("step", 2))
    first_forward = next(i for i, e in enumerate(log) if i > second and e[0] == "fwd")
    # the step-1 gathers were all issued before step 2's forward began ...
    assert [e for e in log[:first_forward] if e[0] == "gather"] == [("gather",)] * n
    # ... and each was waited for inside step 2's forward; the head's bucket (0) after the
    # embedding and attention had run
    waits = [(i, e[1]) for i, e in enumerate(log) if e[0] == "wait" and second < i < log.index(("step", 3))]
    assert sorted(w for _, w in waits) == list(range(n))
    head_wait = dict((w, i) for i, w in waits)[0]
    assert ("fwd", "embed") in log[first_forward:head_wait] and ("fwd", "attn") in log[first_forward:head_wait]
    # each wait sits right before the forward of the first unit (a child of the model, with its
    # subtree: param_gather.gather_units) holding a parameter of its bucket
    names = {m: name for name, m in model.named_modules()}
    owner = {name: set() for name in names.values() if name}
    for unit, params in gather_units([model]):
        if names[unit]:
            owner[names[unit]] |= {opt.reducer.bucket_of(p).index for p in params}
    for i, w in waits:
        nxt = next(e for e in log[i:] if e[0] == "fwd")
        assert w in owner[nxt[1]], (w, nxt, owner)
        assert not any(w in owner[e[1]] for e in log[first_forward:i] if e[0] == "fwd"), (w, i)
    # overlapped, synchronous, stage 1 and 2 and the serial AdamW all train the same model
    sync, _ = train_zero(ps, False, 3, stage=1)
    serial, _ = serial_train(3)
    for (name, a), b, s in zip(model.named_parameters(), sync.parameters(), serial.parameters()):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, s, rtol=0, atol=1e-5)
    assert not opt.param_gather.pending
    # a read outside forward (a checkpoint) waits for the gathers first
    opt.zero_grad()
    backward_step(model, opt.reducer, 4, ps.dp_size, ps.dp_rank, m=1)
    opt.step(lr_at(4))
    assert opt.param_gather.pending
    opt.state_dict()
    assert not opt.param_gather.pending


def all_checks(ps) -> bool:
    check_uncompressed_order(ps)
    check_compressed_overlap(ps)
    check_param_gather_overlap(ps)
    return True


def test_overlap_by_order_of_events():
    """Under the stream-order checker (tests/helpers/stream_check.py): the reducer's overlapped
    buckets, the exchange worker and ZeRO's overlapped all-gathers order every access."""
    assert all(run_distributed(stream_checked, grid=RankGrid(dp=2), args=(all_checks,)))
