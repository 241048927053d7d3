"""The step's host waits as the trainer reports them: counted while the step runs, drawn on the
timeline where they happened; and the timeline of the last steps (``StepTimeline``).

``watch_syncs`` opens the counting window of engine/device/syncs.py around the device part of a
step (not the host's collation of its batch: those are host tensors, whose reads wait for
nothing). Under ``--compile`` the dispatch mode and the patched tensor methods would be traced
into the graphs, so only a device runtime's own report counts there (CUDA's, ``native``); on a
device without one the step's waits cannot be known and ``host_syncs`` is null. Where the dispatch
mode counts (CPU, NPU: no runtime report) it about doubles a small model's host time, so it runs
on step 1 and every ``--host-sync-interval``-th step (default ``--log-interval``), and the other
steps' ``host_syncs`` are null (``counts_step``); CUDA's own report counts every step.
``sync_events`` turns a step's ``SyncEvent``s into "sync" instants of its timeline track.
``StepTimeline`` keeps the last steps' outputs unconverted: converting a step's stamps right after
it would wait for its update; they are converted when the trace is written, after the last wait.
"""
from __future__ import annotations

import contextlib

from parallel.pipeline.timeline import TimelineEvent, gather_events, write_chrome_trace


def counted_step(trainer, batches, lr: float, timer, step: int):
    """``trainer.stepper.run`` (of 1-based ``step``) inside the step's counting window, the
    whole-step ``timer`` stopped there and the previous step's record completed (read without
    waiting: after this step's wait). Returns (StepOutput, the step's SyncEvents, or None where
    they cannot be known, ``known_syncs``, or are not counted this step, ``counts_step``)."""
    syncs = trainer.clock.syncs
    counted = counts_step(trainer, step)
    syncs.begin_step()
    try:
        with watch_syncs(trainer) if counted else contextlib.nullcontext():
            out = trainer.stepper.run(batches, lr)
            timer.stop()
            trainer.late_records.complete()
    finally:
        events = syncs.end_step()
    return out, events if counted and known_syncs(trainer) else None


def counts_step(trainer, step: int) -> bool:
    """Whether 1-based ``step``'s host waits are counted: every step where the device runtime
    reports them itself (CUDA), else step 1 and every ``--host-sync-interval``-th (default
    ``--log-interval``): the dispatch mode that sees them costs host time on every op."""
    syncs, log = trainer.clock.syncs, trainer.cfg.log
    if not syncs.strict:
        return True
    every = log.host_sync_interval or log.log_interval
    return step == 1 or step % every == 0


def known_syncs(trainer) -> bool:
    """Whether the step's waits are all seen: always in eager mode; under ``--compile`` only
    through a device runtime's own report (CUDA)."""
    return not trainer.cfg.compile or trainer.clock.syncs.native is not None


def watch_syncs(trainer):
    """The counting window of ``trainer``'s clock for the step's device work (under --compile
    the device runtime's report alone, where there is one)."""
    syncs = trainer.clock.syncs
    if trainer.cfg.compile:
        return syncs.watching_native() if syncs.native is not None else contextlib.nullcontext()
    return syncs.watching()


def sync_events(out, syncs, step: int) -> list[TimelineEvent]:
    """``out``'s (a StepOutput) timeline events of ``step`` (1-based) and a "host sync: NAME"
    marker for each of its waits that carries a stamp (resolve after the step's figures are
    complete: converting stamps waits for them otherwise)."""
    events = list(out.events)
    for e in events:
        e.args["step"] = step
    for sync in syncs or ():
        if sync.stamp is not None:
            at = out.wall(sync.stamp)
            events.append(TimelineEvent(out.rank, f"host sync: {sync.name}", "sync", at, at,
                                        args={"step": step}))
    return events


class StepTimeline:
    """--timeline's steps: the last ``keep`` (step, StepOutput, SyncEvents), written at the end."""

    def __init__(self, keep: int):
        self.keep, self.steps = keep, []

    def add(self, step: int, out, syncs) -> None:
        self.steps.append((step, out, syncs))
        del self.steps[:-self.keep]

    @property
    def events(self) -> list[TimelineEvent]:
        """The kept steps' events, with a "sync" marker where each step waited for the device."""
        return [e for step, out, syncs in self.steps for e in sync_events(out, syncs, step)]

    def write(self, ps, grid, path: str) -> None:
        """Gather every rank's events on rank 0 (a collective) and write the Chrome trace there."""
        gathered = gather_events(ps, self.events)
        if ps.rank == 0:
            labels = {r: f"rank {r} (tp {c.tp}, pp {c.pp}, dp {c.dp})"
                      for r in range(ps.world_size) for c in [grid.coord(r)]}
            write_chrome_trace(path, gathered, labels)
