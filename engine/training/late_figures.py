"""The figures of a step that are read at the next step's wait, not at its own.

A step waits for the device once (engine/device/syncs.py), at its statistics read, before the
update: the loss scaler's skip decision and the clipping coefficient need the overflow flag and the
norm on the host. What the device does after that wait (the clipping, the update and ZeRO's
parameter all-gather) is still queued when the step returns, so those spans (``time_clip_s``,
``time_optimizer_s``) and the step's total are read at the next step's wait, when they are long complete, or by ``flush`` after
the last step.

The measured bubble needs the pipeline phase's first and last instants over the pipeline's ranks:
known on the host only after the step's wait, so they are reduced (``pipeline_bubble_tensor``, no
host read) and ride on the next step's statistics all-reduce, together with the per-stage compute
means of ``bubble_simulated``. A step's record is therefore finalized one step late; the trainer
writes it then (engine/training/step_record.py's ``LateRecords``).

The pipeline's transfers ride along the same way (parallel/pipeline/transfers.py): the phase's
MAX all-reduce also carries every rank's post times, from which each rank computes on the device
its exposed transfer time (``time_pp_exposed_s``, a world mean) and its receives' mean latency
per direction; with the stages' post time per transfer they travel in the statistics all-reduce
and let ``bubble_simulated`` replay the schedule with the measured transfers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.pipeline.bubble import COMPUTE_CATS, PhaseTimes, pipeline_bubble_tensor, reduce_phase
from parallel.pipeline.transfers import (DIRECTIONS, local_posts, message_slots,
                                         post_per_transfer, rank_exposure)

LATE_TIME_KEYS = ("time_clip_s", "time_optimizer_s")  # their spans end after the wait


@dataclass
class LateFigures:
    """One step's figures still to read: its update's span and, with a pipeline, its phase."""
    out: object                  # the step's engine.training.step.StepOutput, completed in place
    update: tuple                # stamps: before the statistics, after the clipping, after the update
    phase: PhaseTimes | None     # this rank's pipeline phase (pp > 1), read at the step's wait
    stage_times: tuple = ()      # this rank's (fwd, bwd, W) means in its stage's slots
    transfers: tuple | None = None  # (the whole schedule, this rank's TransferSpans): pp > 1

    def carried(self, ps) -> tuple[tuple, tuple]:
        """(per-rank, per-stage) values for the next statistics all-reduce: the bubble as a device
        tensor (one pp all-reduce, no host read) and the stage compute means; with the transfers,
        also the exposed transfer time, each stage's receive latencies (per-rank slots: a rank
        fills its stage's) and its post time per transfer."""
        if self.phase is None:
            return (), ()
        if self.transfers is None:
            return (pipeline_bubble_tensor(ps, self.phase),), tuple(self.stage_times)
        lists, spans = self.transfers
        slots, partner = message_slots(lists)
        bubble, posts = reduce_phase(ps, self.phase, local_posts(spans, ps.pp_rank, slots,
                                                                 len(slots)))
        exposed, latency = rank_exposure(lists, ps.pp_rank, spans, posts, (slots, partner))
        pp = ps.pp_size
        slot = torch.zeros(len(DIRECTIONS) * pp, dtype=torch.float32, device=posts.device)
        for d, value in enumerate(latency):
            slot[d * pp + ps.pp_rank] = value
        post = [0.0] * pp
        post[ps.pp_rank] = post_per_transfer(spans)
        return (bubble, exposed, *slot.unbind()), (*self.stage_times, *post)

    def complete(self, clock, stats=None) -> None:
        """Fill the step's late figures: after a wait that followed its update (``stats``: that
        wait's StepStats, carrying this step's bubble and stage means)."""
        out = self.out
        a, b, c = self.update
        out.times["time_clip_s"], out.times["time_optimizer_s"] = clock.elapsed_s(a, b), clock.elapsed_s(b, c)
        if self.phase is not None and stats is not None:
            out.extra["bubble_measured"] = stats.per_rank[0]
            k = len(COMPUTE_CATS)
            out.extra["stage_fwd_s"] = stats.per_stage[0::k]
            out.extra["stage_bwd_s"] = stats.per_stage[1::k]
            out.extra["stage_wgt_s"] = stats.per_stage[2::k]
            if self.transfers is not None:  # see carried(): slot means times pp = stage means
                pp = len(stats.per_stage) // (k + 1)
                out.extra["stage_fwd_s"] = stats.per_stage[0:k * pp:k]
                out.extra["stage_bwd_s"] = stats.per_stage[1:k * pp:k]
                out.extra["stage_wgt_s"] = stats.per_stage[2:k * pp:k]
                out.extra["stage_post_s"] = stats.per_stage[k * pp:]
                out.extra["time_pp_exposed_s"] = stats.per_rank[1]
                lat = [v * pp for v in stats.per_rank[2:]]
                out.extra["stage_latency_f_s"], out.extra["stage_latency_b_s"] = lat[:pp], lat[pp:]
        out.complete = True
