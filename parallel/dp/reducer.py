"""Data-parallel gradient reducer: bucketed, overlapped with backward, optionally compressed.

One training step, as the trainer drives it::

    reducer.zero_grad()                        # or optimizer.zero_grad(), which calls it
    for i, mb in enumerate(micro_batches):
        reducer.set_last_microbatch(i == len(micro_batches) - 1)
        (loss(mb) / len(micro_batches)).backward()
    reducer.finish()                           # main_grad now holds the DP-averaged gradient

Gradients accumulate in ``param.main_grad`` (a view into a flat fp32 buffer, see buffers.py). A
parameter of the buffer's dtype (fp32) gets ``param.grad`` pointed at that view, so autograd
accumulates into the buffer itself and no copy follows (DDP's ``gradient_as_bucket_view``, the
effect of Megatron's gradient-accumulation fusion); for a low-precision parameter the hook adds
``param.grad`` into ``main_grad`` and frees it. A post-accumulate-grad hook per parameter counts
the accumulations and launches the buckets. Earlier micro-batches only accumulate; during
the last one, a bucket's exchange is launched as soon as all its gradients are in, so communication
overlaps the rest of backward. Buckets are launched strictly in index order (the backward order),
so every DP rank issues the same collectives in the same sequence even if hooks fire in a slightly
different order. Gradients are divided by dp before the sum, giving the mean. Under a zero-bubble
schedule (``split_weight_grads``) no ``param.grad`` is a view: a backward that leaves a weight's
gradient to W leaves ``param.grad`` unset, and the hook does not count it.

Uncompressed buckets are async collectives issued from the hook. In a step where compression is
active (after the policy's warm-up) every bucket goes to the ``ExchangeWorker`` instead
(exchange.py): compressed buckets are encoded, exchanged and decoded on its thread while backward
continues, and uncompressed ones are issued from there too, so one thread orders all DP
collectives, on ``ps.dp_exchange_group`` (the same ranks on a communicator of the worker's own:
parallel/runtime/lanes.py), as does the variance refresh. ``finish()`` waits for everything. The
compressed exchange, the statistics, the residuals and the reducer's checkpoint state are
reducer_compressed.py's (``CompressedSide``, a base of ``GradReducer``).

Schedules where one step runs several backward passes per parameter in an interleaved order
(virtual pipeline stages) can use ``set_num_microbatches(n)`` instead: a parameter then counts as
final on its n-th accumulation (``n * param.uses_per_microbatch`` for a weight two chunks of one
rank share, the V placement's tied embedding). Zero-bubble schedules add weight gradients into
``main_grad`` themselves, in their W actions (parallel/grads/weight_grad.py), and report each with
``grad_accumulated(param)``, which counts like the hook, once per (micro-batch, chunk) whether B,
W or both accumulated it (``split_weight_grads``): a bucket launches when its last W ran. Parameters that receive no gradient are reduced by ``finish()``,
but they hold back every bucket after theirs until then: freeze them (requires_grad=False).

After ``finish()`` further element-wise reductions (sequence-parallel norms over TP, tied
embeddings over the embedding group) remain valid, also on ZeRO shards.

ZeRO (``shard(stage)``, called by the distributed optimizer): buckets are reduce-scattered, and
only this rank's shard of each bucket holds the averaged gradient after ``finish()`` (an expert
bucket is cut over its expert-data-parallel group: ``bucket.shard_rank`` of ``bucket.shard_world``). Stage 1 keeps
the full buffer; stage 2 frees it (buffers.py): a bucket's full gradient exists from its first
gradient of the step until its reduce-scatter completes (completed collectives are collected at
every launch), then only the persistent 1/dp shard remains. A compressed bucket under ZeRO runs
only the first phase of its exchange (compression.py).

The reduction runs over ``ps.dp_cp_group``: the data-parallel replicas and, with context
parallelism, the CP ranks that hold the same parameters (one collective over the combined group).
``stats()`` reads this step's collectives over that group from the communication layer's counters.

``pre_reduce_hooks`` are called with each bucket as it is launched, before it is divided by dp and
reduced: the bucket then holds this rank's own accumulated gradients (engine/observe/anomaly.py looks for
non-finite ones there, before the reduction spreads them to every replica).
"""
from __future__ import annotations

import math

import torch

from parallel.dp.buffers import Bucket
from parallel.dp.layout import build_buffers, named_parameters, tp_class
from parallel.dp.exchange import ExchangeWorker
from parallel.dp.policy import CompressionPolicy
from parallel.dp.reducer_compressed import CompressedSide
from parallel.dp.variance import LocalVariance
from parallel.grid.state import ParallelState


class GradReducer(CompressedSide):
    def __init__(self, params, ps: ParallelState, bucket_size_mb: float = 25.0,
                 grad_dtype: torch.dtype = torch.float32,
                 compression_policy=None, overlap: bool = True,
                 named_params: list[tuple[str, torch.nn.Parameter]] | None = None,
                 unit_of: dict | None = None, device=None, deferred: bool = False):
        """``params``: a Module, (name, param) pairs or parameters (then named by ``named_params``,
        if given, else param0, param1, ...). ``compression_policy``: a CompressionPolicy, its dict
        form, or a config with grad_compression / grad_compression_ratio / grad_compression_policy.
        ``overlap=False`` launches every bucket in ``finish()`` (for measuring what overlap buys).
        ZeRO-3 (buffers.py): ``unit_of`` ends buckets at gather units, ``device`` holds the
        gradients (default: the parameters'), ``deferred`` builds no flat buffer (``shard(2 or 3)``
        must follow before the first backward).
        """
        named = named_parameters(params)
        if named_params is not None:
            names = {p: n for n, p in named_parameters(named_params)}
            named = [(names.get(p, n), p) for n, p in named]
        if not named:
            raise ValueError("GradReducer: no parameter requires grad")
        if bucket_size_mb <= 0:
            raise ValueError(f"GradReducer: bucket_size_mb must be positive, got {bucket_size_mb}")
        if not grad_dtype.is_floating_point:
            raise ValueError(f"GradReducer: grad_dtype must be a floating dtype, got {grad_dtype}")
        compression_policy = CompressionPolicy.coerce(compression_policy)
        self.ps, self.group = ps, ps.dp_cp_group
        self.dp, self.dp_rank = self.group.size, self.group.rank
        self.policy, self.overlap, self.grad_dtype = compression_policy, overlap, grad_dtype
        self.shard_grads, self.zero_stage = False, 0
        self.beta2 = 0.999                  # Adam's, for the local variance (set by the optimizer)
        self.loss_scaler = None             # the trainer's (its .scale); local variance unscaled by it
        self.local_clip = 0.0               # the trainer's clipping norm, for top-k's local clip
        self._split = None                  # the B/W split's WeightGradStore (split_weight_grads)
        self.names = {p: n for n, p in named}

        elem = torch.empty((), dtype=grad_dtype).element_size()
        bucket_numel = max(1, int(bucket_size_mb * 2 ** 20) // elem)
        # equal shards, 64-byte aligned in fp32 (over DP x CP, and over EDP for expert buckets)
        world = math.lcm(self.dp, ps.edp_group.size)
        pad = world * 16 if world > 1 else 1
        position = {p: i for i, (_, p) in enumerate(reversed(named))}   # the backward order
        self.buffers, experts = build_buffers(named, self.policy, grad_dtype, bucket_numel, pad,
                                              unit_of, device, deferred)
        self.buckets: list[Bucket] = sorted((b for buf in self.buffers for b in buf.buckets),
                                            key=lambda b: position[b.slots[0].param])
        self._bucket_of = {}
        device = self.buffers[0].device
        for i, bucket in enumerate(self.buckets):
            # the group a bucket is summed over (and ZeRO-sharded over); the division stays by the
            # DP x CP size, since an expert's gradient already holds its EP ranks' tokens' share.
            # A compressed expert bucket is exchanged over the EDP ranks on the worker's lane.
            expert = bucket.buffer in experts
            bucket.group = ps.edp_group if expert else None
            group = bucket.group or self.group
            bucket.shard_rank, bucket.shard_world = group.rank, group.size
            bucket.exchange_group = ps.edp_exchange_group if expert else ps.dp_exchange_group
            # (an expert bucket of one EDP rank, ep = dp x cp, has nothing to exchange)
            bucket.index = i
            bucket.compressor = bucket.spec.build() if group.size > 1 or self.dp == 1 else None
            if bucket.compressor is not None and group.size > 1:
                bucket.compressor.allocate(bucket.numel, group.size, False, device)
                if bucket.compressor.sparse and self.policy.variance_refresh != 0:
                    # the statistics only feed the refreshes: none without a schedule
                    bucket.variance = LocalVariance(bucket.numel, device)
            for slot in bucket.slots:
                self._bucket_of[slot.param] = bucket
        self.compressed = self.dp > 1 and any(b.compressor is not None for b in self.buckets)
        missing = [b for b in self.buckets if b.compressor is not None and b.exchange_group is None]
        if self.compressed and missing:
            which = "EDP" if missing[0].group is not None else "DP"
            raise ValueError(f"GradReducer: gradient compression over the {which} group needs its "
                             "exchange group; build the state with ParallelState.initialize(..., "
                             "dp_exchange=True) and init_expert_groups(..., exchange=True)")
        self._worker = ExchangeWorker(device) if self.compressed else None
        # autograd accumulates straight into the buffer for parameters of the gradient's dtype
        self._aliased = [p for _, p in named if p.dtype == grad_dtype]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self.pre_reduce_hooks: list = []    # fn(bucket), before each bucket's reduction
        self.post_reduce_hooks: list = []   # fn(bucket), once its reduced shard is in place
        self.clock = None                   # a DeviceClock: finish() stamps its wait (the step's)
        self.wait_stamps = None             # (start, end) of finish()'s wait, None: none waited
        self.step = 1                       # 1-based optimizer step, advanced by finish()
        self._num_mb = None
        self.refreshed: dict[int, torch.Tensor] = {}
        self._reset_step_state()
        self._point_grads()

    def _point_grads(self) -> None:
        """param.grad = main_grad for parameters of the buffer's dtype (not under ZeRO-2/3, whose
        bucket storage only exists during the step)."""
        if self.zero_stage < 2:
            for p in self._aliased:
                p.grad = p.main_grad

    def split_weight_grads(self, store) -> None:
        """The B/W split (parallel/grads/weight_grad.py): ``store``'s W actions accumulate into
        ``main_grad`` themselves and tell ``grad_accumulated``. ``param.grad`` stops pointing at
        ``main_grad`` (a backward that defers a weight leaves it unset: the hook must see that, and
        not count it), and a gradient autograd accumulates while B captures is noted with the
        store, which counts it once with that (micro-batch, chunk)'s W."""
        for p in self._aliased:
            if p.grad is p.main_grad:
                p.grad = None
        self._aliased = []
        self._split = store

    # ---- configuration by the optimizer ---------------------------------------------------------
    def shard(self, stage: int) -> None:
        """ZeRO: reduce-scatter buckets; ``stage`` 2 also frees the full gradient buffers (3: the
        same for gradients; the parameters are parallel/dp/zero3.py's)."""
        if stage not in (1, 2, 3):
            raise ValueError(f"GradReducer.shard: ZeRO stage must be 1, 2 or 3, got {stage}")
        if stage == 1 and self.buffers[0].data is None:
            raise ValueError("GradReducer.shard: a deferred reducer has no flat buffer for ZeRO-1")
        if self._pending or (self._worker is not None and self._worker.busy):
            raise RuntimeError("GradReducer.shard: collectives in flight; call finish() first")
        self.shard_grads, self.zero_stage = True, stage
        if stage >= 2:      # (an expert buffer's shards are over its expert-data-parallel group)
            for buf in self.buffers:
                buf.release(buf.buckets[0].shard_world)
            for p in self._aliased:
                p.grad = None
        for b in self.buckets:
            if b.compressor is not None and self.dp > 1:
                b.compressor.allocate(b.numel, b.shard_world, True, b.own_view().device)

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket | None:
        return self._bucket_of.get(param)

    def compressing(self, step: int | None = None) -> bool:
        """Whether compressed buckets go through their compressor at 1-based ``step``."""
        return self.compressed and self.policy.active(self.step if step is None else step)

    def refresh_due(self, step: int) -> bool:
        """Whether the sparse buckets' second moment is (re)set from the ranks' local statistics
        at ``step``, on the policy's ``variance_refresh`` schedule (warmup.py)."""
        return (self.compressing(step) and self.policy.refresh_due(step)
                and any(b.variance is not None for b in self.buckets))

    # ---- per-step protocol ----------------------------------------------------------------
    def set_last_microbatch(self, is_last: bool) -> None:
        """Mark whether the coming backward pass is the step's last one for these parameters
        (reset to False by zero_grad() and finish())."""
        self._is_last = bool(is_last)

    def set_num_microbatches(self, n: int | None) -> None:
        """Alternative to set_last_microbatch: a parameter is final on its n-th accumulation."""
        if n is not None and n < 1:
            raise ValueError(f"GradReducer: number of micro-batches must be >= 1, got {n}")
        self._num_mb = n

    def zero_grad(self) -> None:
        """Zero every buffer, drop param.grad and reset the step's counters and statistics."""
        if self._pending or (self._worker is not None and self._worker.busy):
            raise RuntimeError("GradReducer.zero_grad: collectives still in flight; call finish() first")
        for buf in self.buffers:
            if buf.data is not None:
                buf.data.zero_()
            for b in buf.buckets:
                b.free_storage()
                b.compressed_step = False
            for slot in buf.slots:
                slot.param.grad = None
        self._point_grads()
        self.refreshed = {}
        self._reset_step_state()

    def finish(self) -> None:
        """Launch any bucket not yet launched, wait for all, and advance the step counter."""
        if self._finished:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        # the wait for what is still in flight after the backward: time_dp_exposed_s
        start = self.clock.stamp() if self.clock is not None and \
            (self._pending or self._via_worker) else None
        if self._via_worker:
            if self.refresh_due(self.step):            # after every bucket, on the same thread
                self._worker.submit(self._refresh)
            results = self._worker.drain()
            self._pending += [r for r in results if isinstance(r, tuple)]
            self.refreshed = next((r for r in results if isinstance(r, dict)), {})
            self._sum_partial_refresh()
        for item in self._pending:
            if item[0] is not None:
                item[0].wait()
            self._complete(item)
        self._pending = []
        if start is not None:
            self.wait_stamps = (start, self.clock.stamp())
        self._finished = True
        self._is_last = False
        self.step += 1

    def _sum_partial_refresh(self) -> None:
        """A partial-gradient bucket's refreshed statistics (``sequence_parallel``: each TP rank
        saw its own part of the gradient) summed over TP, so that every TP rank refreshes the same
        variance and the replicas stay equal (layout.py ``tp_class``)."""
        if self.ps.tp_group.size == 1:
            return
        for index, stats in self.refreshed.items():
            bucket = self.buckets[index]
            if tp_class(bucket.slots[0].param, bucket.spec) == "partial":
                self.ps.tp_group.all_reduce(stats)

    @property
    def finished(self) -> bool:
        return self._finished

    def check_finished(self, who: str) -> None:
        if not self._finished:
            raise RuntimeError(f"{who}: gradients are not reduced yet; call reducer.finish() after backward")

    def stats(self) -> dict[str, int]:
        """This step's collectives over the reducer's group since ``zero_grad()``: ``calls``,
        ``payload_bytes`` (bytes of the tensors handed over) and ``wire_bytes`` (ring model);
        ZeRO's parameter all-gathers count too once the optimizer has stepped."""
        return self.ps.comm.since(self._snapshot)[self.group.kind]

    @property
    def num_launched(self) -> int:
        """Buckets launched so far this step (all of them before finish() when overlap works)."""
        return self._next

    # ---- hooks and launches ----------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self.wait_stamps = None
        self._snapshot = self.ps.comm.snapshot()
        self._is_last = False
        self._counts: dict = {}
        self._ready: dict[int, set] = {}
        self._next = 0
        self._pending: list = []
        self._finished = False
        self._via_worker = self.compressing()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if param.grad is None:
            # autograd runs the hook with no gradient when a backward returned None for the
            # parameter: a layer that left its weight gradient to a W action
            return
        if self._split is not None and self._split.capturing:
            self._take_grad(param)     # counted once, with this B's W (split_weight_grads)
            self._split.note(param)
            return
        self.grad_accumulated(param)

    def _take_grad(self, param: torch.nn.Parameter) -> None:
        """A gradient left in ``param.grad`` (not accumulated in place, as when ZeRO-2 had freed
        the bucket's storage) into ``main_grad``."""
        if self._finished:
            raise RuntimeError("GradReducer: backward after finish(); call zero_grad() to start a step")
        grad = param.grad
        if grad is not None and grad is not param.main_grad:
            bucket = self._bucket_of[param]
            if bucket.storage is None and bucket.shard is not None:
                bucket.ensure_storage()                    # ZeRO-2/3: first gradient of the step
            param.main_grad.add_(grad)
            param.grad = None

    def grad_accumulated(self, param: torch.nn.Parameter) -> None:
        """One more gradient of ``param`` is in its ``main_grad`` (the hook's add, or a W action's
        accumulation, once per (micro-batch, chunk)): count it, and launch its bucket once every
        parameter of it is final."""
        self._take_grad(param)
        bucket = self._bucket_of[param]
        count = self._counts[param] = self._counts.get(param, 0) + 1
        final = self._num_mb is not None and \
            count >= self._num_mb * getattr(param, "uses_per_microbatch", 1)
        if not (self._is_last or final):
            return
        ready = self._ready.setdefault(bucket.index, set())
        ready.add(param)
        if self.overlap and len(ready) == len(bucket.slots):
            buckets, nxt = self.buckets, self._next
            while nxt < len(buckets) and len(self._ready.get(nxt, ())) == len(buckets[nxt].slots):
                self._launch(buckets[nxt])
                nxt = self._next

    def _launch(self, bucket: Bucket) -> None:
        self._next = bucket.index + 1
        bucket.ensure_storage()   # (ZeRO-2/3: a bucket that got no gradient reduces zeros)
        for hook in self.pre_reduce_hooks:
            hook(bucket)
        if self.dp == 1 and not self.shard_grads:
            return
        if self._via_worker:
            compressed = bucket.compressor is not None
            bucket.compressed_step = compressed
            self._worker.submit(self._exchange if compressed else self._start, bucket,
                                bucket.exchange_group)   # DP x CP, or EDP for an expert bucket
        else:
            self._pending.append(self._start(bucket))
            if self.zero_stage >= 2:
                self._collect_completed()

    def _start(self, bucket: Bucket, group=None):
        """Issue the bucket's uncompressed async collective on ``group`` (the worker passes its
        own; default the reducer's): (handle, bucket, output or None)."""
        group = group or bucket.group or self.group
        data = bucket.data
        if bucket.variance is not None:                    # a sparse bucket's warm-up step
            self._local_variance(bucket, data)
        data.div_(self.dp)
        if self.shard_grads:
            out = bucket.shard if bucket.shard is not None else \
                torch.empty(bucket.numel // bucket.shard_world, dtype=data.dtype, device=data.device)
            return group.reduce_scatter_into(out, data, async_op=True), bucket, out
        return group.all_reduce(data, async_op=True), bucket, None

    def _complete(self, item) -> None:
        """After the bucket's collective is done: its output into place, ZeRO-2 storage freed."""
        _, bucket, out = item
        if out is not None and out is not bucket.shard:
            bucket.own_view().copy_(out)
        bucket.free_storage()
        for hook in self.post_reduce_hooks:
            hook(bucket)

    def _collect_completed(self) -> None:
        """ZeRO-2: finish the reduce-scatters that are done, freeing their buckets' storage. A
        done handle is still waited: NCCL keeps a collective's tensors alive through its handle
        (instead of record_stream) and lets them go at ``wait()``; a handle dropped unwaited
        holds them until its watchdog next sweeps. On a finished collective the wait costs no
        host time."""
        keep = []
        for item in self._pending:
            if item[0] is None or item[0].is_completed():
                if item[0] is not None:
                    item[0].wait()
                self._complete(item)
            else:
                keep.append(item)
        self._pending = keep

    # ---- teardown ----------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._worker is not None:
            self._worker.close()
