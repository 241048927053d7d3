"""ZeRO-2 against ZeRO-1, the unsharded optimizer and serial AdamW, and the exact memory keys
against the formulas of each stage and against the storage the tensors really hold."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from parallel.runtime import streams
from parallel.runtime.comm_monitor import TrackedWork
from parallel.dp import DistributedOptimizer, GradReducer, MixedPrecisionOptimizer, memory_bytes
from parallel.dp.buffers import Bucket
from parallel.grid.state import ParallelState
from parallel.runtime.stream_check import StreamChecker
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.stream_check import stream_checked
from tests.parallel.dp.test_dp_reducer import backward_step, groups, lr_at, make_model, serial_train

SMALL = 300 * 4 / 2 ** 20
POLICY = {"default": "none", "warmup_steps": 1, "rules": [
    {"pattern": "mlp*", "compressor": "topk", "ratio": 0.1}, {"pattern": "attn*", "compressor": "int8"}]}


def train(ps, stage: int, steps: int, dtype=torch.float32, policy=None):
    model = make_model(dtype)
    reducer = GradReducer(model, ps, bucket_size_mb=SMALL, compression_policy=policy)
    if stage:
        opt = DistributedOptimizer(groups(model), reducer, ps, lr=0.0, betas=(0.9, 0.95),
                                   zero_stage=stage, overlap_param_gather=True)
        opt.register_param_gather_hooks([model])
    else:
        opt = MixedPrecisionOptimizer(groups(model), reducer, ps, lr=0.0, betas=(0.9, 0.95))
    norms = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        backward_step(model, reducer, step, ps.dp_size, ps.dp_rank, m=2)
        if stage == 2:   # only the shards are left: no full gradient anywhere
            assert all(b.storage is None for b in reducer.buckets)
            assert all(getattr(p, "main_grad", None) is None for p in model.parameters())
        norms.append(opt.clip_grad_norm(0.5))
        opt.step(lr_at(step))
    if stage:
        opt.finish_param_gather()
    return model, opt, reducer, norms


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share their base's)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def check_stages(ps) -> None:
    ref, _, _, ref_norms = train(ps, 0, 4)
    serial, serial_norms = serial_train(4)
    for stage in (1, 2):
        model, opt, _, norms = train(ps, stage, 4)
        assert norms == pytest.approx(ref_norms, rel=1e-6), stage
        for (name, a), b, s in zip(model.named_parameters(), ref.parameters(), serial.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"stage {stage} vs stage 0: {name}")
            torch.testing.assert_close(a, s, rtol=0, atol=1e-5, msg=f"stage {stage} vs serial: {name}")
    # stage 1 and 2 differ only in where the shard lives: bit-identical
    one, opt1, _, _ = train(ps, 1, 3, torch.bfloat16)
    two, opt2, _, _ = train(ps, 2, 3, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(one.parameters(), two.parameters()))
    assert torch.equal(opt1.master.owned, opt2.master.owned) and torch.equal(opt1.exp_avg_sq, opt2.exp_avg_sq)


def check_memory(ps) -> None:
    dp = ps.dp_size
    for dtype in (torch.float32, torch.bfloat16):
        for stage in (0, 1, 2):
            model, opt, reducer, _ = train(ps, stage, 1, dtype)
            mem = memory_bytes(reducer, opt)
            n = sum(p.numel() for p in model.parameters())
            padded = sum(b.numel for b in reducer.buckets)                 # >= n, a multiple of 16 dp
            elem = torch.empty((), dtype=dtype).element_size()
            grads = 4 * padded // (dp if stage == 2 else 1)
            if stage == 0:
                tensors = len(list(model.parameters()))
                state = 8 * n + 4 * tensors + (4 * n if dtype != torch.float32 else 0)
                params = elem * n
            else:   # exp_avg, exp_avg_sq of this rank's shards (padding included), and an fp32
                # master copy for bf16 parameters (fp32 ones are their own master)
                state = (8 if dtype == torch.float32 else 12) * padded // dp
                params = elem * padded
            assert (mem["param_bytes"], mem["grad_bytes"], mem["optimizer_state_bytes"]) == \
                (params, grads, state), (dtype, stage, mem)
            assert mem["param_bytes_by_dtype"] == {str(dtype)[6:]: params}
            # ... and what the tensors really hold
            held_params = storage_bytes(model.parameters())
            held_grads = storage_bytes([b.shard for b in reducer.buckets] if stage == 2 else
                                       [buf.data for buf in reducer.buffers])
            if stage:
                held_state = storage_bytes([opt.master.owned, opt.exp_avg, opt.exp_avg_sq])
            else:
                st = [t for s in opt.inner.state.values() for t in s.values()]
                held_state = storage_bytes(st + [m for m, p in zip(opt.masters, opt.params) if m is not p])
            assert (held_params, held_grads, held_state) == (params, grads, state), (dtype, stage)
    # compression adds its residuals (the bucket, plus the owner's shard without ZeRO) and, for
    # top-k, the local squared-gradient statistics and its velocity, seeded from exp_avg at the
    # end of the warm-up (the one step here): the whole bucket, or under ZeRO this rank's shard
    # until the first compressed exchange gathers it
    for stage in (0, 2):
        model, opt, reducer, _ = train(ps, stage, 1, policy=POLICY)
        extra = 0
        for b in reducer.buckets:
            if b.compressor is not None:
                extra += 4 * b.numel + (0 if stage else 4 * b.numel // dp)
            if b.variance is not None:
                extra += 4 * b.numel
            if b.spec.kind == "topk":
                extra += 4 * b.numel // dp if stage else 4 * b.numel
        n, padded = sum(p.numel() for p in model.parameters()), sum(b.numel for b in reducer.buckets)
        adam = 8 * padded // dp if stage else 8 * n + 4 * len(list(model.parameters()))
        assert extra > 0 and memory_bytes(reducer, opt)["optimizer_state_bytes"] == adam + extra
        held = storage_bytes([t for b in reducer.buckets if b.compressor
                              for t in b.compressor.state_tensors()]
                             + [b.variance.sq for b in reducer.buckets if b.variance is not None])
        # (under ZeRO the seed shard is a copy of exp_avg's: a storage of its own)
        assert held == extra


def check_every_handle_waited(ps) -> None:
    """ZeRO-2 finishes a reduce-scatter it finds done (``is_completed``) by waiting on its handle
    too: NCCL holds the collective's tensors through the handle until ``wait()``. Here every
    ``is_completed`` first lets the collective finish, so each bucket takes that path."""
    made, waited = [], set()
    real_init, real_wait = TrackedWork.__init__, TrackedWork.wait

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def wait(self, *args, **kwargs):
        waited.add(id(self))
        return real_wait(self, *args, **kwargs)

    def is_completed(self):
        self.work.wait()            # the collective itself, not the handle's wait
        return True

    with mock.patch.object(TrackedWork, "__init__", init), \
            mock.patch.object(TrackedWork, "wait", wait), \
            mock.patch.object(TrackedWork, "is_completed", is_completed):
        train(ps, 2, 2)
    assert made and all(id(w) in waited for w in made), (len(made), len(waited))


def all_checks(ps) -> bool:
    check_stages(ps)
    check_memory(ps)
    check_every_handle_waited(ps)
    return True


@pytest.mark.parametrize("dp", [2, 4])
def test_zero2_and_memory_on_gloo(dp):
    assert all(run_distributed(all_checks, grid=RankGrid(dp=dp)))


def _compressed_zero(ps) -> bool:
    """ZeRO-2 and ZeRO-1 with compression on the exchange worker and the overlapped all-gather."""
    for stage in (2, 1):
        train(ps, stage, 3, policy=POLICY)
    return True


def _compressed_zero_checks(ps):
    """The engine under the checker, then ZeRO-2 with the original defect planted back (the
    worker's release without record_stream): its violations."""
    clean = stream_checked(ps, _compressed_zero)
    real = Bucket.free_storage
    Bucket.free_storage = lambda self, used_on=None: real(self)
    checker = StreamChecker()
    try:
        with checker.installed():
            train(ps, 2, 2, policy=POLICY)
    finally:
        Bucket.free_storage = real
    return clean, checker.violations


def test_zero_with_compression_under_the_stream_checker():
    """The exchange worker frees a ZeRO-2 bucket's storage while its side stream may still read
    it; with record_stream the checker finds no violation on any path of the step, without it
    the release is named."""
    for clean, planted in run_distributed(_compressed_zero_checks, grid=RankGrid(dp=2)):
        assert clean and planted, planted
        assert all(v.startswith("released while in use: storage from zeros at "
                                "parallel/dp/buffers.py") and "ensure_storage" in v
                   and "on stream 'dp-exchange' hands the block to stream 'compute'" in v
                   for v in planted), planted


def test_serial_memory_formulas():
    ps = ParallelState.serial()
    model, opt, reducer, _ = train(ps, 2, 2)
    mem = memory_bytes(reducer, opt)
    padded = sum(b.numel for b in reducer.buckets)
    assert mem["grad_bytes"] == 4 * padded and mem["optimizer_state_bytes"] == 8 * padded


def test_freed_bucket_storage_is_recorded_on_the_stream_that_still_reads_it(monkeypatch):
    """ZeRO-2 with compression frees a bucket's full gradient on the exchange worker right after
    queueing its reduce-scatter on the side stream: the caching allocator must be told that stream
    uses the block (``record_stream``), or it could hand it to the next backward before the side
    stream has read it. On CPU there are no streams, so the call is recorded by a stand-in."""
    from parallel.dp import CompressorSpec
    from parallel.dp.buffers import GradBuffer
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((t, s)))
    param = torch.nn.Parameter(torch.zeros(8))
    buf = GradBuffer([("w", param)], CompressorSpec("topk", 0.5), bucket_numel=8)
    buf.release(world=2)
    bucket = buf.buckets[0]
    bucket.ensure_storage()
    storage = bucket.storage
    side = streams.Stream("dp-exchange", torch.device("cpu"), native=object())  # a device stream
    bucket.free_storage(used_on=side)
    assert recorded == [(storage, side.native)] and bucket.storage is None and param.main_grad is None
    bucket.ensure_storage()
    bucket.free_storage()  # freed on the stream that allocated it: nothing to record
    assert len(recorded) == 1


def test_a_release_without_record_stream_is_caught(stream_checker):
    """The checker's view of the same release: the side stream's read of the storage is covered
    by record_stream, and is a violation without it."""
    from parallel.dp import CompressorSpec
    from parallel.dp.buffers import GradBuffer
    param = torch.nn.Parameter(torch.zeros(8))
    buf = GradBuffer([("w", param)], CompressorSpec("topk", 0.5), bucket_numel=8)
    buf.release(world=2)
    bucket = buf.buckets[0]
    side = streams.side_stream("dp-exchange", "cpu")
    for used_on in (side, None):
        bucket.ensure_storage()
        streams.wait_stream(side, streams.current_stream("cpu"))
        with streams.use(side):
            bucket.storage.sum()                    # the worker's encode reads the gradient
            bucket.free_storage(used_on=used_on)
    (message,) = stream_checker.violations
    assert message.startswith("released while in use") and "'dp-exchange'" in message
    assert "hands the block to stream 'compute'" in message
    assert "parallel/dp/buffers.py" in message     # the storage's origin: ensure_storage
    stream_checker.violations.clear()
