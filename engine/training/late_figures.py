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
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.pipeline.bubble import COMPUTE_CATS, PhaseTimes, pipeline_bubble_tensor

LATE_TIME_KEYS = ("time_clip_s", "time_optimizer_s")  # their spans end after the wait


@dataclass
class LateFigures:
    """One step's figures still to read: its update's span and, with a pipeline, its phase."""
    out: object                  # the step's engine.training.step.StepOutput, completed in place
    update: tuple                # stamps: before the statistics, after the clipping, after the update
    phase: PhaseTimes | None     # this rank's pipeline phase (pp > 1), read at the step's wait
    stage_times: tuple = ()      # this rank's (fwd, bwd, W) means in its stage's slots

    def carried(self, ps) -> tuple[tuple, tuple]:
        """(per-rank, per-stage) values for the next statistics all-reduce: the bubble as a device
        tensor (one pp all-reduce, no host read) and the stage compute means."""
        if self.phase is None:
            return (), ()
        return (pipeline_bubble_tensor(ps, self.phase),), tuple(self.stage_times)

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
        out.complete = True
