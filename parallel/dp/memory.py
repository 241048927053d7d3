"""Exact bytes of what data parallelism allocates per rank, computed from the constructed objects.

``memory_bytes(reducer, optimizer)`` counts the tensors the reducer and the optimizer hold between
steps, by dtype (numel x element size, padding included), so a dry-run tool can compare against it
to the byte:

- ``param_bytes``: the model parameters the reducer holds (under ZeRO-1/2 their flat buffers,
  which carry the buckets' padding; under ZeRO-3 this rank's persistent shards, 1/dp of them:
  a unit's gathered buckets exist only while it runs, and ``peak_memory_bytes`` sees them);
- ``grad_bytes``: the gradient buffers (stages 0 and 1: the full fp32 buffers; stage 2: the
  persistent 1/dp shards, since a bucket's full gradient is only alive from its first gradient of
  a step until its reduce-scatter completes);
- ``optimizer_state_bytes``: fp32 masters and Adam moments (ZeRO: 8 bytes per element of this
  rank's shards, 12 for bf16/fp16 parameters, whose fp32 master is a copy; torch's AdamW: 8 bytes per element plus a 4-byte step per tensor, plus an fp32
  master per low-precision parameter), and the compressors' state: error-feedback residuals (the
  bucket's fp32 values, plus the owner's 1/dp shard without ZeRO) and, for top-k, the local
  squared-gradient statistics (the bucket's fp32 values).

Formulas per rank for a model of N parameters in buckets of total padded size P (P >= N) and AdamW:

    stage 0: grads 4P, state 8N + 4 (#tensors) [+ 4N masters if params are bf16/fp16]
    stage 1: grads 4P, state 8 P / dp [12 P / dp if params are bf16/fp16]
    stage 2: grads 4 P / dp, state 8 P / dp [12 P / dp if params are bf16/fp16]

With expert parallelism the expert buckets (this rank's E/ep experts, padded size P_e) are cut
over the expert-data-parallel group instead, so under ZeRO P / dp reads P_d / dp + P_e / edp
(edp = dp / ep; with dp read as dp x cp): the shards' own sizes are counted.

With ``--optimizer-cpu-offload`` the offloaded buckets' masters and moments are host memory:
``optimizer_state_bytes`` counts what stays on the device, ``optimizer_state_host_bytes`` the
host's 12 bytes per offloaded shard element (master, exp_avg, exp_avg_sq), and
``grad_host_bytes`` the host copies of those gradient shards (4 bytes, plus a staging copy in the
parameters' dtype for bf16/fp16 parameters); both are 0 without offload.

Transient buffers (a ZeRO-2 bucket during backward, a ZeRO-3 unit's gathered buckets, a
compressor's packed messages) are not included; ``peak_memory_bytes`` sees them.
"""
from __future__ import annotations

from collections import Counter

import torch


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def memory_bytes(reducer, optimizer) -> dict:
    """{"param_bytes", "grad_bytes", "optimizer_state_bytes", "optimizer_state_host_bytes",
    "grad_host_bytes"} plus ``*_by_dtype`` breakdowns (of the device's)."""
    params, grads, state = Counter(), Counter(), Counter()
    sharded = getattr(optimizer, "sharded", False)
    shards = getattr(getattr(optimizer, "param_gather", None), "shards", None)   # ZeRO-3
    offload = getattr(optimizer, "offload", None)
    for buf in reducer.buffers:
        if shards is not None:
            for b in buf.buckets:
                params[_name(buf.param_dtype)] += _nbytes(shards[b.index].numel(), buf.param_dtype)
        elif sharded:
            params[_name(buf.param_dtype)] += _nbytes(buf.numel, buf.param_dtype)
        else:
            for _, p in buf.named_params:
                params[_name(p.dtype)] += _nbytes(p.numel(), p.dtype)
        if buf.data is not None:
            grads[_name(buf.grad_dtype)] += _nbytes(buf.numel, buf.grad_dtype)
        else:
            for b in buf.buckets:
                grads[_name(buf.grad_dtype)] += _nbytes(b.shard.numel(), b.shard.dtype)
    if sharded:   # (the offloaded buckets' moments are host memory)
        n = optimizer.exp_avg.numel() - (offload.numel if offload is not None else 0)
        owned = getattr(optimizer.master, "owned_numel", n)       # fp32 params are their master
        state["float32"] += _nbytes(2 * n + owned, torch.float32)  # exp_avg, exp_avg_sq, master
    elif optimizer is not None:
        for p, m in zip(optimizer.params, optimizer.masters):
            state["float32"] += 2 * _nbytes(p.numel(), torch.float32) + 4   # moments + step
            if m is not p:
                state[_name(m.dtype)] += _nbytes(m.numel(), m.dtype)
    for b in reducer.buckets:
        tensors = b.compressor.state_tensors() if b.compressor is not None else []
        if b.variance is not None:
            tensors.append(b.variance.sq)
        for t in tensors:
            state[_name(t.dtype)] += _nbytes(t.numel(), t.dtype)
    host = offload.host_bytes() if offload is not None else \
        {"optimizer_state_host_bytes": 0, "grad_host_bytes": 0}
    out = {"param_bytes": sum(params.values()), "grad_bytes": sum(grads.values()),
           "optimizer_state_bytes": sum(state.values()), **host}
    out.update(param_bytes_by_dtype=dict(params), grad_bytes_by_dtype=dict(grads),
               optimizer_state_bytes_by_dtype=dict(state))
    return out
