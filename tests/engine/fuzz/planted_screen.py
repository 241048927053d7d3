"""Defects planted in the paths only the screening fuzzer draws (module-level functions: the
fuzzer's pool calls one in each rank it starts, ``engine.fuzz.pool.Pool(setup=...)``).

Example: ``cli.fuzz([ScreenCase(pp=2, layers=2, precision="fp16", overflow=True)], 3, 120.0,
setup=overflow_skip_per_rank)`` fails its case with "rank 1 skipped step 1 and rank 0 did not":
the stage whose gradients overflowed skips its update while the other stage applies its own.
"""
from __future__ import annotations


def overflow_skip_per_rank() -> None:
    """fp16's overflow skip decided by each rank from its own gradients, as a loss scaler wired
    before the flag joined the step's grid-wide statistics: the rank's own overflow flag decides,
    and the grid's norm is not consulted (a rank whose shard is finite applies its update)."""
    import math

    import engine.training.step as step
    stats, apply = step.grad_stats, step.apply_grad_stats
    own = {}

    def grad_stats(optimizer, scaler, overflow=None, share=False):
        out = stats(optimizer, scaler, overflow, share)
        own["found"] = float(out[0])
        return out

    def apply_grad_stats(optimizer, scaler, found, norm_sq, clip_grad=0.0, reducer=None):
        found = own.pop("found", found)
        if found == 0 and not math.isfinite(norm_sq):  # this rank's gradients were finite:
            norm_sq = 0.0                               # it sees no reason to skip
        return apply(optimizer, scaler, found, norm_sq, clip_grad, reducer)

    step.grad_stats, step.apply_grad_stats = grad_stats, apply_grad_stats


def exchange_by_half() -> None:
    """The compressed exchange averages over half the replicas it sums: every compressed step's
    gradient is twice the mean (the warm-up's plain reduction is right)."""
    from parallel.dp.reducer_compressed import CompressedSide
    exchange = CompressedSide._exchange

    def _exchange(self, bucket, group):
        bucket.data.mul_(2.0)
        return exchange(self, bucket, group)

    CompressedSide._exchange = _exchange
