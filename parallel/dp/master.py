"""ZeRO's fp32 master values of this rank's shards, without a copy where the parameters are fp32.

Why. Under ZeRO the parameters of a gradient buffer live in one flat tensor with the buffer's
layout (buffers.bind_param_buffer), so this rank's shard of a bucket's parameters is a contiguous
run of that tensor. When the parameters are fp32 that run already is the master: keeping a second
copy costs 4 bytes per shard element for nothing (12 bytes of optimizer state where exp_avg and
exp_avg_sq need 8). As Megatron's distributed optimizer does, the update then writes straight
into the parameters' own shard, and the parameter all-gather sends that shard in place. Buckets
of bf16/fp16 parameters keep an fp32 copy of their shard, as before.

``MasterShards`` is addressed like the flat tensor it replaces: ``master[off:off + n]`` for any
range inside one bucket's shard, at the offsets of the optimizer's flat moments.
"""
from __future__ import annotations

import torch

PARAM, MIRROR, OWNED = "param", "mirror", "owned"


class MasterShards:
    def __init__(self, shards, own_shard, device, host=None):
        """``shards``: (bucket, offset in the flat moments, length) per bucket; ``own_shard``:
        bucket -> this rank's shard of its parameters (ParamGather's or ZeRO-3's ShardedParams').
        ``host``: bucket -> its offloaded master (offload.py), or None where the bucket's master
        stays on the device; an offloaded fp32 master mirrors the parameters' shard (the update
        copies it back each step), so it is not stored apart (``aliased``)."""
        owned = sum(n for b, _, n in shards
                    if b.param_dtype != torch.float32 and (host is None or host(b) is None))
        self.owned = torch.zeros(owned, dtype=torch.float32, device=device)
        self._runs: list[tuple[int, int, torch.Tensor, str]] = []   # (offset, n, view, kind)
        pos = 0
        for b, off, n in shards:
            away = host(b) if host is not None else None
            if away is not None:
                self._runs.append((off, n, away, MIRROR if b.param_dtype == torch.float32 else OWNED))
            elif b.param_dtype == torch.float32:   # (its shard over the bucket's own group)
                self._runs.append((off, n, own_shard(b), PARAM))
            else:
                self._runs.append((off, n, self.owned[pos:pos + n], OWNED))
                pos += n
        self._numel = sum(n for _, _, n in shards)

    def _run(self, sl: slice):
        start = sl.start or 0
        stop = self._numel if sl.stop is None else sl.stop
        for off, n, view, kind in self._runs:
            if off <= start and stop <= off + n and (n > 0 or start == off):
                return view[start - off:stop - off], kind
        raise IndexError(f"master range [{start}, {stop}) is not inside one bucket's shard")

    def __getitem__(self, sl: slice) -> torch.Tensor:
        return self._run(sl)[0]

    def __setitem__(self, sl: slice, value) -> None:
        self._run(sl)[0].copy_(value)

    def aliased(self, sl: slice) -> bool:
        """Whether the range holds the parameters' own values (fp32 parameters: their storage,
        or its offloaded mirror), so it is not stored apart from them."""
        return self._run(sl)[1] != OWNED

    def kind(self, sl: slice) -> str:
        """PARAM (the parameters' storage), MIRROR (an offloaded copy of fp32 parameters, set
        from them) or OWNED (the fp32 master of low-precision parameters)."""
        return self._run(sl)[1]

    def numel(self) -> int:
        return self._numel

    def flat(self) -> torch.Tensor:
        """A copy of every master value in the order of the flat moments (for comparisons)."""
        return torch.cat([view for _, _, view, _ in self._runs]) if self._runs else self.owned.clone()

    @property
    def device(self) -> torch.device:
        return self.owned.device

    @property
    def owned_numel(self) -> int:
        """Elements this object allocates (the low-precision buckets' copies)."""
        return self.owned.numel()
