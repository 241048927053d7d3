"""The compressed side of ``GradReducer`` (reducer.py), a mixin on it: a compressed bucket's whole
exchange on the ``ExchangeWorker``'s thread, the sparse buckets' local variance statistics and
their refresh, the compressors' error-feedback residuals, and the reducer's state (its step
counter, the policy's warm-up phase and the residuals) for checkpoints. It reads the reducer's
``buckets``, ``policy``, ``dp``, ``step``, ``shard_grads``, ``beta2``, ``loss_scaler``,
``local_clip`` and ``_worker``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from parallel.dp.buffers import Bucket


class CompressedSide:
    """GradReducer's compressed exchange, statistics, residuals and state (module docstring)."""

    def _exchange(self, bucket: Bucket, group) -> None:
        """A compressed bucket's whole exchange (on the worker thread, over its ``group``)."""
        data = bucket.data
        if bucket.variance is not None:
            self._local_variance(bucket, data)
        data.div_(self.dp)
        bucket.compressor.prepare_step(self.step - self.policy.warmup_steps,
                                       self.policy.sparsity_warmup_steps, self.local_clip)
        if self.shard_grads:
            bucket.compressor.reduce_scatter_(data, group, bucket.own_view())
            # the side stream may still read the storage: the allocator must not hand the block to
            # the next backward (on the compute stream) before that work is done
            bucket.free_storage(used_on=self._worker.stream)
        else:
            bucket.compressor.all_reduce_(data, group)

    def _refresh(self) -> dict[int, torch.Tensor]:
        """The sparse buckets' local statistics averaged over the ranks that hold them (DP x CP,
        EDP for an expert bucket): {bucket index: full or shard} (on the worker thread, after
        every bucket)."""
        return {b.index: b.variance.average(b.exchange_group, self.beta2, self.shard_grads)
                for b in self.buckets if b.variance is not None}

    def _local_variance(self, bucket: Bucket, data: torch.Tensor) -> None:
        """This rank's own gradient (before the division by dp) into its statistics, unscaled."""
        scale = 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)
        bucket.variance.update_(data, self.beta2, 1.0 / scale)

    def rescale_residuals(self, factor: float) -> None:
        """The loss scale changed by ``factor``: keep error-feedback residuals in the new units
        (the local variance statistics are kept unscaled)."""
        for bucket in self.buckets:
            if bucket.compressor is not None:
                bucket.compressor.rescale_(factor)

    def step_applied(self) -> None:
        """The step just finished is applied: the residuals its exchanges started from are
        dropped (compression.py ``commit``)."""
        for bucket in self.buckets:
            if bucket.compressor is not None:
                bucket.compressor.commit()

    def step_skipped(self) -> None:
        """The step just finished is not applied (an overflow, a non-finite gradient): its
        exchanges are undone and the step counter goes back.

        - The error-feedback residuals (and the momentum of 1-bit Adam and DGC) go back to what
          the step started from: the new ones may hold inf/nan, and zeroing them would drop the
          mass still pending from the steps before (top-k's unsent values, many steps' worth).
        - A refresh computed this step is dropped. The local statistics stay: a non-finite
          gradient never entered them (variance.py ``update_``), and wiping them made the next
          refresh, which a skipped refresh step retries at once, replace Adam's v by one sample.
        - The warm-up, the variance-refresh schedule and top-k's density ramp count applied
          updates, as the optimizer's own step does: a skipped warm-up step counted would start
          compression on a second moment that no update has set (frozen Adam dividing by eps).
        """
        for bucket in self.buckets:
            if bucket.compressor is not None:
                bucket.compressor.reset()
        self.refreshed = {}
        self.step -= 1

    def layout_digest(self) -> str:
        """What this rank's residuals are laid out by (each bucket's parameters and ranges, and
        its compressor), hashed: a checkpoint restores them as saved only onto the same layout
        (``--bucket-size-mb`` and ``--sequence-parallel`` change it as well as the grid)."""
        parts = [[b.index, b.numel, getattr(b.compressor, "name", None),
                  [[s.name, s.start, s.end] for s in b.slots]] for b in self.buckets]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """Step counter, compressor residuals and local variance statistics (per rank; they depend
        on the DP layout)."""
        state = {}
        for b in self.buckets:
            if b.compressor is not None:
                state.update({f"bucket{b.index}.{k}": v for k, v in b.compressor.state_dict().items()})
            if b.variance is not None:
                state.update({f"bucket{b.index}.variance_{k}": v for k, v in b.variance.state_dict().items()})
        return {"step": self.step, "warmup_steps": self.policy.warmup_steps, "residuals": state}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        if state.get("warmup_steps") is not None:       # the saved phase wins (warmup.py)
            self.policy = dataclasses.replace(self.policy, warmup_steps=int(state["warmup_steps"]))
        residuals = state.get("residuals", {})
        for b in self.buckets:
            prefix = f"bucket{b.index}."
            mine = {k[len(prefix):]: v for k, v in residuals.items() if k.startswith(prefix)}
            if b.compressor is not None:
                b.compressor.load_state_dict({k: v for k, v in mine.items() if not k.startswith("variance_")})
            if b.variance is not None and "variance_sq" in mine:
                b.variance.load_state_dict({"sq": mine["variance_sq"], "count": mine["variance_count"]})
