"""ZeRO's parameter all-gather, one collective per bucket, overlapped with the next forward
(Megatron-LM's ``--overlap-param-gather``).

After the update each rank holds the new values of its shard of every bucket only. ``launch``
starts one async all-gather per bucket, in the order forward uses them (the reverse of the backward
bucket order), straight into the parameters: under ZeRO they are views into one flat tensor per
gradient buffer with the same layout (``buffers.bind_param_buffer``), so no copy follows. With
overlap on, a forward pre-hook on every module that owns parameters waits for the buckets of its
own parameters just before it runs, so the gathers of later layers are still in flight while the
first layers compute. Without overlap ``launch`` waits at once.

A parameter is waited for in the pre-hook of the module that owns it. Everything that reads
parameters outside a forward must call ``wait_all()`` first (the optimizer does so in its own
``step``, ``state_dict``, ``grad_norm`` and ``clip_grad_norm``; the trainer before validation, a
checkpoint save and the end of training): ``pending`` says whether anything is still in flight.
"""
from __future__ import annotations

import torch

from parallel.dp.buffers import bind_param_buffer


class ParamGather:
    def __init__(self, reducer, overlap: bool):
        self.reducer, self.overlap = reducer, overlap
        self.group = reducer.group
        self.flat = {id(buf): bind_param_buffer(buf) for buf in reducer.buffers}
        self._handles: dict[int, tuple] = {}     # bucket index -> (work, input shard kept alive)
        self._hooks: list = []
        self.on_wait = None                      # test hook: called with the bucket index
        self.clock = None                        # a DeviceClock: each wait is stamped
        self.waited: list = []                   # (start, end) stamps of the waits since cleared

    def output(self, bucket) -> torch.Tensor:
        """The bucket's parameters as one flat tensor of their dtype."""
        return self.flat[id(bucket.buffer)][bucket.start:bucket.end]

    def launch(self, shards) -> None:
        """``shards``: (bucket, this rank's updated values in the parameters' dtype) per bucket."""
        self.wait_all()
        for bucket, shard in sorted(shards, key=lambda x: -x[0].index):   # forward order
            group = bucket.group or self.group       # an expert bucket: its EDP group
            work = group.all_gather_into(self.output(bucket), shard, async_op=self.overlap)
            if work is not None:
                self._handles[bucket.index] = (work, shard)
        if not self.overlap:
            self.wait_all()

    def wait(self, index: int) -> None:
        item = self._handles.pop(index, None)
        if item is not None:
            if self.on_wait is not None:
                self.on_wait(index)
            start = self.clock.stamp() if self.clock is not None else None
            item[0].wait()
            if start is not None:  # the step's time_zero_gather_exposed_s (engine/training/step.py)
                self.waited.append((start, self.clock.stamp()))

    def wait_all(self) -> None:
        for index in sorted(self._handles, reverse=True):
            self.wait(index)

    @property
    def pending(self) -> bool:
        return bool(self._handles)

    def register_hooks(self, modules) -> None:
        """Forward pre-hooks on every module (of ``modules`` and their children) that directly
        owns parameters of this reducer: each waits for the buckets of those parameters."""
        if not self.overlap:
            return
        seen = set()
        for root in modules:
            for module in root.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                own = {self.reducer.bucket_of(p).index for p in module.parameters(recurse=False)
                       if self.reducer.bucket_of(p) is not None}
                if own:
                    self._hooks.append(module.register_forward_pre_hook(self._waiter(sorted(own))))

    def _waiter(self, indices: list[int]):
        def hook(module, args):
            if self._handles:
                for index in indices:
                    self.wait(index)
        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
