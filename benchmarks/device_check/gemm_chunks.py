"""The device check's cost of the TP overlap's decomposition on one device: the column-parallel
GEMM of ``--tp-comm-overlap`` runs on tp chunks of the gathered sequence, one per ring step
(parallel/tensor_parallel/overlap.py), and the row-parallel one produces tp chunks of its output.
With one device there is no ring to hide, so what is left to measure is what cutting the GEMM
costs: device time of the chunked GEMMs against the one plain GEMM on the same operands, and that
they compute the same values.

Times are device times (engine/device/clock.py: events on CUDA/NPU, perf_counter on CPU), the
median of ``repeats`` timed runs after one warm-up run.
"""
from __future__ import annotations

import statistics

import torch

from engine.device.clock import DeviceClock


def _chunked(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tp: int) -> torch.Tensor:
    """out[c] = x[c] @ w.T for each of the tp sequence chunks c (what the ring's steps compute)."""
    for xc, oc in zip(x.chunk(tp), out.chunk(tp)):
        torch.matmul(xc, w.t(), out=oc)
    return out


def _median_s(clock: DeviceClock, fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        a = clock.stamp()
        fn()
        times.append(clock.elapsed_s(a, clock.stamp()))
    return statistics.median(times)


def time_chunked_gemm(device: torch.device, dtype: torch.dtype, tokens: int = 8192,
                      hidden: int = 2048, ffn: int = 8192, tps=(2, 4, 8), repeats: int = 10
                      ) -> list[dict]:
    """One row per tp: {"tp", "plain_ms", "chunked_ms", "ratio", "max_err"} for the (tokens,
    hidden) x (hidden, ffn / tp) GEMM of one TP rank's column-parallel layer."""
    clock = DeviceClock(device.type)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for tp in tps:
        if tokens % tp:
            continue
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)         # (s, h) gathered
        w = torch.randn(ffn // tp, hidden, generator=gen).to(device, dtype)      # (f/tp, h)
        plain = torch.empty(tokens, ffn // tp, device=device, dtype=dtype)
        chunked = torch.empty_like(plain)
        plain_s = _median_s(clock, lambda: torch.matmul(x, w.t(), out=plain), repeats)
        chunked_s = _median_s(clock, lambda: _chunked(x, w, chunked, tp), repeats)
        scale = max(1.0, float(plain.abs().max()))
        err = float((plain.float() - chunked.float()).abs().max()) / scale
        rows.append({"tp": tp, "plain_ms": 1e3 * plain_s, "chunked_ms": 1e3 * chunked_s,
                     "ratio": chunked_s / plain_s, "max_err": err})
    return rows
