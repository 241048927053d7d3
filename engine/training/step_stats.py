"""The step's statistics: its one grid-wide all-reduce and its one host read.

``reduce_step_stats`` sums [loss, overflow flag, share of the squared norm, per-rank values,
per-stage values, agreement counts] over the world in one fp32 all-reduce and reads it once
(``DeviceClock.read``: the step's one wait, engine/device/syncs.py); ``StepAgreement`` is how
small integers every rank must agree on (the checkpointer's stop and save counters) ride on it;
``mean_loss_over_grid`` is validation's one read per batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.device.clock import DeviceClock
from parallel.grid.state import ParallelState
from parallel.runtime import streams

def mean_loss_over_grid(local_sum, ps: ParallelState, device,
                        holds_loss: bool | None = None, clock: DeviceClock | None = None) -> float:
    """The global-batch loss from one fp32 all-reduce over the world (HCCL reduces no float64):
    held by the ranks of tp rank 0 that run the last virtual stage (``holds_loss``; default the
    last pipeline rank), averaged over DP x CP. ``local_sum``: a float or a 0-d device tensor
    (then the all-reduce's result is the one host read, through ``clock`` when given)."""
    owner = (ps.is_last_stage if holds_loss is None else holds_loss) and ps.tp_rank == 0
    if isinstance(local_sum, torch.Tensor):
        t = local_sum.detach().reshape(1).to(torch.float32)
        if not owner:
            t = torch.zeros_like(t)
    else:
        if ps.world_size == 1:
            return local_sum
        t = _to_device([local_sum if owner else 0.0], device)
    if ps.world_size > 1:
        ps.world_group.all_reduce(t)
    value = clock.read(t, "loss read")[0] if clock is not None else t.tolist()[0]
    return value / (ps.dp_size * ps.cp_size)


@dataclass
class StepStats:
    loss: float                  # mean token loss over the global batch
    found_inf: float             # > 0: some rank overflowed
    grad_norm_sq: float          # squared global gradient norm (after unscaling)
    per_rank: list[float]        # world means of the per-rank values
    per_stage: list[float]       # per-stage means of the per-stage values
    counts: list[float] = field(default_factory=list)  # world sums of the agreement's counts
    local: list[float] = field(default_factory=list)   # this rank's ``local`` values, not reduced


class StepAgreement:
    """Small non-negative integers that every rank adds to the step's statistics all-reduce, summed
    over the world (exact in fp32 up to 2**24). Each source is ``fn() -> list[int]`` of a fixed
    width, called once per execution of the step; ``agreed[name]`` are the sums, identical on every
    rank. Example: the checkpointer's [stop requested, by SIGINT, save written, save failed] on 4
    ranks of which one got SIGTERM and all finished writing: [1, 0, 4, 0]."""

    def __init__(self):
        self.sources: dict[str, tuple[int, object]] = {}

    def set(self, name: str, width: int, fn) -> None:
        self.sources[name] = (width, fn)

    def local(self) -> list[int]:
        out = []
        for name, (width, fn) in self.sources.items():
            values = [int(v) for v in fn()]
            if len(values) != width or min(values, default=0) < 0:
                raise ValueError(f"StepAgreement: {name} must give {width} non-negative integers, "
                                 f"got {values}")
            out += values
        return out

    def split(self, values) -> dict[str, list[int]]:
        out, k = {}, 0
        for name, (width, _) in self.sources.items():
            out[name] = [int(round(v)) for v in values[k:k + width]]
            k += width
        return out


def _to_device(values: list[float], device) -> torch.Tensor:
    """Host floats as a device tensor without a host sync (pinned memory, asynchronous copy)."""
    return streams.to_device(torch.tensor(values, dtype=torch.float32), device)


def reduce_step_stats(ps: ParallelState, local_loss: torch.Tensor, grads: torch.Tensor,
                      per_rank: tuple[float, ...] = (),
                      per_stage: tuple[float, ...] = (), counts=(),
                      holds_loss: bool | None = None, clock: DeviceClock | None = None,
                      local=()) -> StepStats:
    """The step's one collective and one host read: [loss, overflow flag, grad norm², per-rank
    values, per-stage values], summed over the world in fp32 (HCCL reduces no float64).

    ``local_loss``: this rank's loss (0-d device tensor), counted on the ranks of tp rank 0 that
    run the last virtual stage (``holds_loss``, as in ``mean_loss_over_grid``) and averaged over
    DP x CP. ``grads``: ``grad_stats(share=True)``'s (flag, this rank's share of the norm²); the
    flags are summed (> 0: an overflow somewhere), the shares add up to the grid-wide norm², so
    the norm needs no collective of its own. ``per_rank`` values (e.g. the idle fraction) are averaged over
    the world, ``per_stage`` ones (each rank fills its own stage's slots) over a stage's ranks;
    ``counts`` (small integers, a StepAgreement's) are summed. A ``per_rank`` value may be a 0-d
    device tensor (the previous step's bubble): it joins without a host read. With ``clock`` the
    read is ``clock.read`` (counted, and the clock's stamps so far are complete after it).
    ``local``: this rank's device scalars that the host needs before the update (on the
    statistics' device), read along after the all-reduce, not reduced (``StepStats.local``).
    """
    device = grads.device
    owner = (ps.is_last_stage if holds_loss is None else holds_loss) and ps.tp_rank == 0
    zero = torch.zeros(1, dtype=torch.float32, device=device)
    parts = [local_loss.reshape(1).to(torch.float32) if owner else zero, grads]
    tensors = [v.reshape(1).to(torch.float32) for v in per_rank if isinstance(v, torch.Tensor)]
    hosts = [v for v in per_rank if not isinstance(v, torch.Tensor)]
    if tensors and hosts:
        raise ValueError("reduce_step_stats: per_rank values are all tensors or all floats")
    parts += tensors
    if hosts or per_stage or counts:
        parts.append(_to_device([*hosts, *per_stage, *counts], device))
    t = torch.cat(parts)
    ps.world_group.all_reduce(t)
    n = len(t)
    t = torch.cat([t, *(v.reshape(1).to(torch.float32) for v in local)]) if local else t
    values = clock.read(t, "statistics") if clock is not None else t.tolist()  # the step's one wait
    values, mine = values[:n], values[n:]
    k, j = 3 + len(per_rank), 3 + len(per_rank) + len(per_stage)
    ranks_per_stage = ps.world_size // ps.pp_size
    return StepStats(values[0] / (ps.dp_size * ps.cp_size), values[1], values[2],
                     [v / ps.world_size for v in values[3:k]],
                     [v / ranks_per_stage for v in values[k:j]], values[j:], mine)
