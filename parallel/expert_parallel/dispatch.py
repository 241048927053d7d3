"""Token dispatch of a mixture-of-experts layer over its expert-parallel group (alltoall).

One layer's forward, T tokens of width h on each rank, each routed to K of E experts, the EP
group of P ranks holding E/P experts each (rank j: experts [j E/P, (j+1) E/P))::

    permute_tokens      (T, h) -> (T K, h) the copies sorted by expert (permute.py)
    alltoall_plan       the counts exchanged (an equal-split all-to-all of (P, E/P), on the
                        device) and the split sizes' host read started: one pinned, non-blocking
                        copy on a side stream (host_read.py) of what this rank sends to each rank
                        and what each sends to it
    alltoall_dispatch   waits for that copy (the layer's one host wait, as late as it can be:
                        after the permutation is queued), then the rows by all_to_all with
                        per-rank split sizes; received rows re-sorted from (source rank, local
                        expert) to (local expert, source rank); the local experts' row offsets
                        stay on the device
    ... the experts run on contiguous row segments (one grouped GEMM per projection) ...
    alltoall_combine    the inverse: re-sort back, all-to-all back with the splits swapped
    unpermute_tokens    (T K, h) -> (T, h) each token's copies times their router weights

Each communication pattern is one autograd.Function named by its forward and backward pair, with
a thin public function taking the group. At ep = 1 nothing is exchanged and nothing is read: the
offsets come from the counts on the device. With a capacity (models/moe/capacity.py) only the kept
rows are sent (their number is the sum of the split sizes already read); ``capacity=C`` (padded
input) gives every expert exactly C rows from every rank, so the splits are known without an
exchange or a host read. The backward reuses the forward's split sizes: no read. Under
torch.compile what the read sizes (the exchange after the read, the combine) runs eagerly and the
rows it hands on are marked dynamic (host_read.py): the split sizes recompile no graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.runtime.comm import CommGroup
from parallel.expert_parallel.host_read import HostReader, PendingRead, dynamic_rows
from parallel.expert_parallel.permute import equal_counts, offsets_of


class _AllToAllVForwardAllToAllVBackward(torch.autograd.Function):
    """Rows ``in_splits[j]`` go to rank j; the gradient travels back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group: CommGroup, out_splits: list, in_splits: list):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        group.all_to_all_v(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.group.all_to_all_v(out, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return out, None, None, None


@dataclass
class DispatchPlan:
    """What the dispatch knows before the rows move: the counts (E,), the exchanged table (P,
    E/P) of what each rank sends to this rank's experts (None: padded), the pending host read of
    [sent per rank (P), that table (P E/P)], and the padded capacity."""
    counts: torch.Tensor
    recv: torch.Tensor | None
    read: PendingRead | None
    capacity: int | None


@dataclass
class DispatchState:
    """What ``alltoall_combine`` needs to invert a dispatch, and the local experts' row offsets."""
    in_splits: list
    out_splits: list
    order: torch.Tensor | None       # sorts the received rows by local expert
    offsets: torch.Tensor            # (E/P,) int32 on the device: each local expert's row end
    groups: torch.Tensor | None = None  # (N,) each row's local expert
    # (E/P P,) int32: the row end of each (local expert, source rank) segment (FP8's weight
    # gradient takes its column scales per source: one micro-batch each, kernels/fp8_grouped.py)
    segments: torch.Tensor | None = None
    # whether the splits were read on the host (False: padded, equal splits) and whether rows were
    # dropped (a capacity without padding: the R rows sent vary from step to step)
    read: bool = False
    dropping: bool = False


def alltoall_plan(counts: torch.Tensor, group: CommGroup, capacity: int | None = None,
                  reader: HostReader | None = None) -> DispatchPlan:
    """The count exchange and the start of the split sizes' host read (nothing at ep = 1 or
    padded)."""
    p = group.size
    if p == 1 or capacity is not None:
        return DispatchPlan(counts, None, None, capacity)
    local = counts.numel() // p
    send = counts.view(p, local).contiguous()   # (P, E/P): row j for rank j's experts
    recv = torch.empty_like(send)                # row i: what rank i sends to my experts
    group.all_to_all_single(recv, send)
    read = (reader or HostReader()).start(torch.cat([send.sum(1), recv.reshape(-1)]))
    return DispatchPlan(counts, recv, read, None)


def alltoall_dispatch(rows: torch.Tensor, plan, group: CommGroup, capacity: int | None = None,
                      segments: bool = True, dropping: bool = False):
    """Send each expert's rows to the EP rank holding it. ``rows`` (R, h) sorted by expert (with
    a capacity, the kept ones first) and the plan (or the counts (E,), planned here) -> (N, h) rows
    of this rank's experts, sorted by local expert, and the state. ``segments``: the (local
    expert, source rank) segments' ends (FP8's weight gradient; off, the state's ``segments`` is
    None); ``dropping``: a capacity without padding drops rows (only the kept ones are sent)."""
    if isinstance(plan, torch.Tensor):
        plan = alltoall_plan(plan, group, capacity)
    p, capacity = group.size, plan.capacity
    local = plan.counts.numel() // p
    if p == 1:
        offsets = offsets_of(plan.counts, rows.shape[0])
        return rows, DispatchState([], [], None, offsets)
    device = rows.device
    local_ids = torch.arange(local, device=device).repeat(p)        # (P E/P,)
    if capacity is not None:
        in_splits = out_splits = [capacity * local] * p
        received = _AllToAllVForwardAllToAllVBackward.apply(rows, group, out_splits, in_splits)
        ids = local_ids.repeat_interleave(capacity, output_size=p * local * capacity)
        expert_in, groups, order = _by_local_expert(received, ids)
        offsets = offsets_of(equal_counts(local, capacity * p, device))
        ends = offsets_of(equal_counts(local * p, capacity, device)) if segments else None
        return expert_in, DispatchState(in_splits, out_splits, order, offsets, groups, ends)
    return _exchange(rows, plan, group, local_ids, segments, dropping)


def _by_local_expert(received: torch.Tensor, ids: torch.Tensor):
    """Received rows in (source rank, local expert) order and their (N,) local experts -> the
    rows sorted by (local expert, source rank), each row's local expert, the sort order."""
    groups, order = torch.sort(ids, stable=True)
    return received.index_select(0, order), groups, order


@torch.compiler.disable
def _exchange(rows: torch.Tensor, plan: DispatchPlan, group: CommGroup, local_ids: torch.Tensor,
              segments: bool, dropping: bool):
    """``alltoall_dispatch`` after the split sizes' host read, eager under torch.compile
    (host_read.py): the splits stay in the state, out of every graph, and the (N, h) rows and
    the (N,) tensors that follow them are marked dynamic."""
    values = plan.read.values()                                       # the one host wait
    p = group.size
    local = local_ids.numel() // p
    in_splits = values[:p]
    table = values[p:]
    out_splits = [sum(table[i * local:(i + 1) * local]) for i in range(p)]
    rows = rows[:sum(in_splits)]                                      # the kept rows
    received = _AllToAllVForwardAllToAllVBackward.apply(rows, group, out_splits, in_splits)
    ids = torch.repeat_interleave(local_ids, plan.recv.reshape(-1),
                                  output_size=sum(out_splits))        # (N,)
    expert_in, groups, order = _by_local_expert(received, ids)        # (N, h), (N,), (N,)
    dynamic_rows(expert_in, groups, order)
    offsets = offsets_of(plan.recv.sum(0))
    ends = offsets_of(plan.recv.t().reshape(-1)) if segments else None  # (expert, source)
    return expert_in, DispatchState(in_splits, out_splits, order, offsets, groups, ends,
                                    read=True, dropping=dropping)


def alltoall_combine(rows: torch.Tensor, state: DispatchState, group: CommGroup) -> torch.Tensor:
    """The inverse of ``alltoall_dispatch``: (N, h) expert outputs -> (R, h) in the sender's order
    (R: the rows it sent)."""
    if state.order is None:
        return rows
    if state.read:
        return _combine_eager(rows, state, group)
    return _combine(rows, state, group)  # padded, equal splits: nothing read, all in the graph


def _combine(rows: torch.Tensor, state: DispatchState, group: CommGroup) -> torch.Tensor:
    back = rows.index_select(0, torch.argsort(state.order))  # (source rank, local expert) again
    return _AllToAllVForwardAllToAllVBackward.apply(back, group, state.in_splits, state.out_splits)


@torch.compiler.disable
def _combine_eager(rows: torch.Tensor, state: DispatchState, group: CommGroup) -> torch.Tensor:
    """The combine sized by the host read, eager under torch.compile (as ``_exchange``); with
    dropped rows (a capacity) the R rows sent are marked dynamic, dropless they are all T K."""
    out = _combine(rows, state, group)
    if state.dropping:
        dynamic_rows(out)
    return out
