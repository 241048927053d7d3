"""The distributed optimizer's state in host memory (``--optimizer-cpu-offload``, Megatron-LM's name).

For the buckets it offloads (the first ``--optimizer-offload-fraction`` of this rank's shard
elements, whole buckets in launch order: the first reduced, the first copied) the fp32 masters and
AdamW's moments live in host memory (pinned on an accelerator: the copies are asynchronous; on the
CPU host and device memory are the same). Each step:

1. **Gradients down.** A bucket's reduced shard is copied to its host buffer as soon as its
   reduction is done (the reducer's ``post_reduce_hooks``), on the side stream "offload-d2h";
   buckets whose gradient is still changed after the reduction (sequence-parallel norms summed
   over TP, a tied embedding's two copies summed) are copied after those sums
   (``grads_synced``). The unscale and the clipping still multiply the device shards (the norm
   and the overflow check read them); each multiplication is repeated on the host copies made
   before it, with the same op (``scale``), so both hold the same values to the bit.
2. **Update on the host.** Per bucket, once its copy has arrived: torch's AdamW on the CPU
   tensors (``torch.optim.adamw.adamw``, its multi-tensor ``foreach`` path: the same
   element-wise arithmetic as the device update in optim_common.py, so the result is the same to
   the bit; the fused CPU kernel rounds differently), weight decay on the bucket's decayed
   segments. The host's work is the named stream "offload-host" to the stream-order checker.
3. **Parameters up.** The new master (cast to the parameters' dtype on the host) is copied into
   the device's shard of the parameters on "offload-h2d", bucket by bucket while the host updates
   the next; the compute stream waits for the copies before anything reads the shards (ZeRO-1/2's
   all-gather, ZeRO-3's next gather).

This is the same model as without offload (tests/parallel/dp/test_zero3.py compares them bit for
bit). DeepSpeed's one-step-delayed update (the host update overlapping the next forward) trains a
different model and is not built.
"""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from parallel.dp.host_flat import HostFlat
from parallel.runtime import streams
from parallel.grads.norm import check_and_unscale_, scale_


def fixed_up(param, ps) -> bool:
    """Whether ``param``'s reduced gradient still changes before the update (sequence-parallel
    parameters summed over TP, a weight tied across pipeline stages summed over its two stages)."""
    return (ps.tp_size > 1 and bool(getattr(param, "sequence_parallel", False))) or \
        bool(getattr(param, "tied_across_stages", False))


class SplitFlat:
    """A flat fp32 vector addressed by offsets, whose first elements, the ``host_entries``
    ((offset, length) of the offloaded buckets, which come first in offset order), live in host
    memory (a ``HostFlat``) and the rest on the device."""

    def __init__(self, host_entries: list[tuple[int, int]], device_numel: int, device, pin: bool):
        self.host = HostFlat(host_entries, torch.float32, pin)
        self.split = self.host.numel()
        self.dev = torch.zeros(device_numel, dtype=torch.float32, device=device)

    def numel(self) -> int:
        return self.split + self.dev.numel()

    def __getitem__(self, sl: slice) -> torch.Tensor:
        start, stop = sl.start or 0, self.numel() if sl.stop is None else sl.stop
        if stop <= self.split:
            return self.host[start:stop]
        if start >= self.split:
            return self.dev[start - self.split:stop - self.split]
        raise IndexError(f"range [{start}, {stop}) crosses host and device memory")

    def __setitem__(self, sl: slice, value) -> None:
        self[sl].copy_(value)


class HostShards:
    """The offloaded buckets of a DistributedOptimizer: their host state and the copies."""

    def __init__(self, shards, fraction: float, ps, device, own_shard):
        """``shards``: the optimizer's (bucket, offset, length, decay segments) in offset order;
        ``own_shard``: bucket -> the device's shard of its parameters."""
        device = self.device = torch.device(device)
        self.ps, self.own_shard = ps, own_shard
        self.pin = device.type not in ("cpu", "meta")
        self.total = total = sum(n for _, _, n, _ in shards)
        self.entries, numel = [], 0
        for entry in shards:
            if total == 0 or numel >= fraction * total:
                break
            self.entries.append(entry)
            numel += entry[2]
        self.numel = numel
        self.buckets = {entry[0].index for entry in self.entries}
        # host vectors as chunks of whole buckets (host_flat.py: no power-of-two rounding of the
        # pinned memory), each addressed by the bucket's (offset, length)
        self.flat_entries = [(off, n) for _, off, n, _ in self.entries]
        self.master = HostFlat(self.flat_entries, torch.float32, self.pin)   # (numel,) fp32
        self.grad = HostFlat(self.flat_entries, torch.float32, self.pin)     # the reduced shards
        low = {b.param_dtype for b, *_ in self.entries} - {torch.float32}
        self.staging = {dt: HostFlat(self.flat_entries, dt, self.pin) for dt in low}
        self.late = {b.index for b, *_ in self.entries
                     if any(fixed_up(slot.param, ps) for slot in b.slots)}
        # high priority: copies the update waits on, never queued behind a communicator's work
        self.d2h = streams.side_stream("offload-d2h", device, high_priority=True)
        self.h2d = streams.side_stream("offload-h2d", device, high_priority=True)
        self.host_stream = streams.side_stream("offload-host", "cpu")
        self._arrived: dict[int, tuple] = {}     # bucket index -> (event, factors applied so far)
        self._factors: list[tuple[str, float]] = []
        self._uploaded = None                    # the last H2D copy's event

    def master_of(self, bucket) -> torch.Tensor | None:
        """The host master of an offloaded bucket's shard (None: the bucket stays on the device)."""
        for b, off, n, _ in self.entries:
            if b is bucket:
                return self.master[off:off + n]
        return None

    @property
    def fraction(self) -> float:
        """The share of this rank's shard elements whose state is in host memory (whole buckets:
        at least ``--optimizer-offload-fraction``)."""
        return self.numel / self.total if self.total else 0.0

    def host_bytes(self) -> dict:
        """Bytes in host memory: the optimizer state (masters, moments) and the gradient copies
        with their staging for low-precision parameters."""
        staged = sum(t.numel() * t.dtype.itemsize for t in self.staging.values())
        return {"optimizer_state_host_bytes": 4 * 3 * self.numel,
                "grad_host_bytes": 4 * self.numel + staged}

    # ---- gradients down ---------------------------------------------------------------------
    def reset(self) -> None:
        """A new step: no gradient has arrived, no factor applies. The last step's copies down may
        still read the shards (a skipped step or a re-run waited for none): the compute stream
        waits for them before the step writes the shards again (called before they are zeroed)."""
        self.before_grad_write()
        self._arrived, self._factors = {}, []

    def grad_ready(self, bucket) -> None:
        """The reducer's post-reduce hook: copy a finished bucket that no fix-up changes."""
        if bucket.index in self.buckets and bucket.index not in self.late:
            self._download(bucket)

    def grads_synced(self) -> None:
        """After the TP and tied-embedding sums: copy every offloaded bucket not copied yet."""
        for b, *_ in self.entries:
            if b.index not in self._arrived:
                self._download(b)

    def _download(self, bucket) -> None:
        off, n = self._place(bucket)
        streams.wait_stream(self.d2h, streams.current_stream(self.device))  # after its reduction
        streams.wait_stream(self.d2h, self.host_stream)   # after the host read the last step's
        with streams.use(self.d2h):
            self.grad[off:off + n].copy_(bucket.own_view(), non_blocking=self.pin)
            self._arrived[bucket.index] = (streams.record_event(self.d2h), len(self._factors))

    def before_grad_write(self) -> None:
        """Before the compute stream multiplies the device shards: after the copies read them."""
        if self._arrived:
            streams.wait_stream(streams.current_stream(self.device), self.d2h)

    def scale(self, kind: str, factor: float) -> None:
        """The device shards were multiplied (``unscale``: the overflow check's unscale and
        check, ``scale``: a plain multiplication, the clipping coefficient); the host copies made
        before get the same op."""
        self._factors.append((kind, factor))

    def _place(self, bucket) -> tuple[int, int]:
        for b, off, n, _ in self.entries:
            if b is bucket:
                return off, n
        raise KeyError(bucket.index)

    # ---- update, parameters up ----------------------------------------------------------------
    @torch.no_grad()
    def update(self, exp_avg: SplitFlat, exp_avg_sq: SplitFlat, step: int, lr: float, betas,
               eps: float) -> None:
        """AdamW on every offloaded bucket in host memory, then its parameters up (module
        docstring). ``exp_avg``/``exp_avg_sq``: the optimizer's moments, host part first."""
        self.grads_synced()                       # (a caller that did not announce the sums)
        streams.wait_stream(self.h2d, streams.current_stream(self.device))  # after reads of shards
        with streams.use(self.host_stream):
            if self._uploaded is not None:        # the last step's copies read the masters
                streams.synchronize(self._uploaded)
            for b, off, n, segments in self.entries:
                event, applied = self._arrived[b.index]
                streams.synchronize(event)
                g = self.grad[off:off + n]
                for kind, factor in self._factors[applied:]:
                    if kind == "unscale":
                        check_and_unscale_([g], factor)
                    else:
                        scale_([g], factor)
                _host_adamw(self.master[off:off + n], g, exp_avg[off:off + n],
                            exp_avg_sq[off:off + n], step, lr, betas, eps, segments)
                self._upload(b, off, n)
        streams.wait_stream(streams.current_stream(self.device), self.h2d)

    def _upload(self, bucket, off: int, n: int) -> None:
        master = self.master[off:off + n]
        source = master
        if bucket.param_dtype != torch.float32:      # cast on the host: half the bytes up
            source = self.staging[bucket.param_dtype][off:off + n]
            source.copy_(master)
        streams.wait_stream(self.h2d, self.host_stream)
        with streams.use(self.h2d):
            self.own_shard(bucket).copy_(source, non_blocking=self.pin)
            self._uploaded = streams.record_event(self.h2d)

    def load_from_params(self) -> None:
        """Masters from the parameters' shards (at start, and after a checkpoint without them)."""
        with torch.no_grad():
            for b, off, n, _ in self.entries:
                self.master[off:off + n].copy_(self.own_shard(b))


def _host_adamw(p, g, m, v, step: int, lr: float, betas, eps: float, segments) -> None:
    """torch's AdamW (``foreach``) on the flat host views of one bucket's shard: one call per
    weight decay, over the runs of the shard that have it (``segments``: decayed (lo, hi, wd)
    ranges; the rest decays 0)."""
    runs, at = [], 0
    for lo, hi, wd in segments:
        if at < lo:
            runs.append((at, lo, 0.0))
        runs.append((lo, hi, wd))
        at = hi
    if at < p.numel():
        runs.append((at, p.numel(), 0.0))
    for wd in dict.fromkeys(r[2] for r in runs):
        mine = [(lo, hi) for lo, hi, d in runs if d == wd]
        adamw([p[lo:hi] for lo, hi in mine], [g[lo:hi] for lo, hi in mine],
              [m[lo:hi] for lo, hi in mine], [v[lo:hi] for lo, hi in mine], [],
              [torch.tensor(float(step - 1)) for _ in mine], foreach=True,
              amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr, weight_decay=wd, eps=eps,
              maximize=False)
