"""ZeRO's parameter all-gather, one collective per bucket, overlapped with the next forward
(Megatron-LM's ``--overlap-param-gather``).

After the update each rank holds the new values of its shard of every bucket only. ``launch``
starts one async all-gather per bucket, in the order forward uses them (the reverse of the backward
bucket order), straight into the parameters: under ZeRO they are views into one flat tensor per
gradient buffer with the same layout (``buffers.bind_param_buffer``), so no copy follows. Without
overlap ``launch`` waits at once.

Where the forward waits: at unit boundaries (``gather_units``), as FSDP's per-block units do. A
unit is a block of the model chunk (an embedding, each transformer layer, the final norm, the
output layer, each a child of the chunk or an element of one of its ``ModuleList``s): its forward
pre-hook waits for the buckets of every parameter in its subtree. The chunk's own parameters are
waited for at the chunk's start. So a parameter is ready before any code inside its block runs,
however that code reads it: through the module that owns it, a parent reading a child's weight
(SwiGLU's gate and up through ``_linear``), a ``ParameterDict`` without a forward (the MoE
experts), a user's block, or a fused kernel handed the weight. The backward's reads of the same
parameters (autograd's saved weights, a recomputation) come after the forward on the same
stream, so they are ordered too. A read of another block's parameter is ordered only when that
block ran earlier in the forward (a tied output layer reads the embedding's weight): a block that
reads a later block's parameters is outside the contract (the stream checker reports it).

Everything that reads parameters outside a forward must call ``wait_all()`` first (the optimizer
does so in its own ``step``, ``state_dict``, ``grad_norm`` and ``clip_grad_norm``; the trainer
before validation, a checkpoint save and the end of training): ``pending`` says whether anything is
still in flight.
"""
from __future__ import annotations

import torch
from torch import nn

from parallel.dp.buffers import bind_param_buffer

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # modules without a forward: their elements are units


def gather_units(roots) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, the parameters its forward pre-hook waits for) for every unit of ``roots`` (the
    model chunks), in module order. Example, a GPT chunk: (chunk, [pos]), (embed, [word]),
    (layers[0], every parameter of layer 0), ..., (final_norm, ...), (output_layer, [weight])."""
    units = []

    def expand(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, CONTAINERS):
                expand(child)
            else:
                units.append((child, list(child.parameters())))

    for root in roots:
        if isinstance(root, CONTAINERS):  # (the trainer's ModuleList of chunks)
            units += gather_units(root.children())
        else:
            units.append((root, list(root.parameters(recurse=False))))
            expand(root)
    return units


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

    def own_shard(self, bucket) -> torch.Tensor:
        """This rank's shard of the bucket's parameters (over the bucket's own group): the run of
        the flat tensor that the optimizer updates and the all-gather sends."""
        s, e = bucket.own_range()
        return self.flat[id(bucket.buffer)][s:e]

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
        """Forward pre-hooks on every unit of ``modules`` (``gather_units``) that holds parameters
        of this reducer: each waits for the buckets of those parameters."""
        if not self.overlap:
            return
        for module, params in gather_units(modules):
            own = {self.reducer.bucket_of(p).index for p in params
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
