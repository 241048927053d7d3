"""The executor's transfers: posting batches, waiting only where a compute step needs them, and the
pipeline's scatter/gather of activations over tensor parallelism.

A batch of consecutive transfer actions (actions.py ``batches``: at most one send to and one
receive from each peer) is posted as one ``batch_isend_irecv`` (``p2p.post``) the moment the rank
reaches it, and not waited for there. A receive is waited for just before the
compute step that consumes it (its F, or its B), and if that step comes right after the batch the
wait follows the post at once (1F1B's ``send_forward_recv_backward`` behaves as before); sends are
waited for at the end of the schedule, or dropped earlier once complete, so a rank never idles for
a neighbour to take what it sent; a batch kept for its sends lets go of its receives once they
are consumed (``PostedBatch.drop``). ``schedules.replay`` models exactly this, and
``validate_schedule`` proves a program free of deadlock even when every batch is waited for as a
whole at once (NCCL and HCCL may coalesce a batch into one work: then the wait before a consumer
covers the batch's sends too).

Scatter/gather (Megatron-LM's ``--scatter-gather-tensors-in-pipeline``, on by default): without
sequence parallelism every TP rank of a stage holds the same (b, s, h) activation, so each sends
only its 1/tp slice of the flattened tensor (and of the gradient) and the receiving stage's TP
ranks all-gather the slices (``tp_group.all_gather_into``) before use: the pipeline link carries
1/tp of the bytes, the TP link of the receiver the rest. Under sequence parallelism the activation
already is each rank's sequence shard, and nothing more is split.
"""
from __future__ import annotations

import math

import torch

from parallel.pipeline.p2p import PostedBatch, Transfer, post, wait_posted
from parallel.tensor_parallel.mappings import _gather, _split


class Split:
    """How one rank's share of a stage boundary tensor is cut: the 1/tp slice of the flattened
    tensor that this TP rank sends, and the all-gather that rebuilds the whole on receipt."""

    def __init__(self, ps, enabled: bool):
        self.group = ps.tp_group
        self.enabled = enabled and self.group.size > 1

    def applies(self, shape) -> bool:
        return self.enabled and math.prod(int(s) for s in shape) % self.group.size == 0

    def piece(self, t: torch.Tensor) -> torch.Tensor:
        """This TP rank's contiguous slice of ``t`` flattened (what it sends)."""
        if not self.applies(t.shape):
            return t.contiguous()
        return _split(t.reshape(-1), 0, self.group)

    def buffer(self, shape, dtype, device) -> torch.Tensor:
        """The receive buffer: the slice's size when split, else the whole tensor."""
        if not self.applies(shape):
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(int(s) for s in shape)
        return torch.empty((numel // self.group.size,), dtype=dtype, device=device)

    def whole(self, received: torch.Tensor, shape) -> torch.Tensor:
        """The tensor every TP rank of the sender held, from this rank's received slice."""
        if not self.applies(shape):
            return received
        return _gather(received, 0, self.group).view(shape)


class Exchange:
    """Posted batches of one rank's step: which consumer waits for which receive, and the sends
    still in flight."""

    def __init__(self, ps, timeout_s, vp: int, waiter=None):
        self.ps, self.timeout_s, self.vp, self.waiter = ps, timeout_s, vp, waiter
        self.waiting: dict[tuple, tuple[PostedBatch, int, object]] = {}  # consumer -> receive
        self.sending: list[tuple[PostedBatch, list[int]]] = []           # batches with sends

    def post(self, transfers: list[Transfer],
             receives: list[tuple[tuple, int, object]]) -> PostedBatch:
        """Post a batch and return it. ``receives``: (consumer key, index in ``transfers``,
        on_arrival(buffer)) for each receive; the consumer key is ("f" | "b", micro, chunk) of the
        step needing it."""
        self.reap()
        batch = post(self.ps, transfers, self.timeout_s, self.vp)
        for key, index, on_arrival in receives:
            self.waiting[key] = (batch, index, on_arrival)
        sends = [i for i, t in enumerate(transfers) if t.op == "send"]
        if sends:
            self.sending.append((batch, sends))
        return batch

    def needs(self, key) -> bool:
        return key in self.waiting

    def wait_for(self, keys) -> bool:
        """Wait for the receives consumed by the steps ``keys`` (one batch's at a time) and hand
        each buffer to its on_arrival; returns whether anything was waited for."""
        found = [(key, self.waiting.pop(key)) for key in keys if key in self.waiting]
        by_batch: dict[int, list] = {}
        for key, (batch, index, on_arrival) in found:
            by_batch.setdefault(id(batch), [batch, []])[1].append((index, on_arrival))
        for batch, items in by_batch.values():
            wait_posted(self.ps, batch, [i for i, _ in items], self.timeout_s, self.vp, self.waiter)
            for index, on_arrival in items:
                on_arrival(batch.transfers[index].tensor)
                batch.drop(index)       # the batch may outlive the consumer (its sends)
        return bool(found)

    def reap(self) -> None:
        """Forget batches whose sends have completed (their buffers can be freed)."""
        self.sending = [(b, sends) for b, sends in self.sending if not b.completed(sends)]

    def finish(self) -> None:
        """Wait for every send still in flight (the end of the schedule)."""
        if self.waiting:
            raise RuntimeError(f"pipeline stage {self.ps.pp_rank}: {len(self.waiting)} received "
                               f"tensors were never used (schedule bug)")
        for batch, sends in self.sending:
            wait_posted(self.ps, batch, sends, self.timeout_s, self.vp, self.waiter)
        self.sending = []
