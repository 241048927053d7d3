"""What the trainer says and does around its steps: notes, stop signals, and the metrics records a
checkpoint's publication waits for.

- ``say_notes``: a flag without effect, a warm-up longer than the run, a chip's fallback, a block
  without a FLOPs formula: one plain line each, ``gridtron: note: ...``, by rank 0.
- ``install_stop_handlers``: SIGTERM (a scheduler's, or torchrun's to every rank) and SIGINT
  (Ctrl-C) only set ``trainer.stop_signal``; the checkpointer's counters carry it to every rank,
  which all stop after the same step (engine/checkpoint/async_writer.py). A second SIGINT leaves
  at once.
- ``records_before_publish``: before checkpoint k becomes ``latest``, the records of steps 1..k
  are written and fsynced; when the run ends at step k (its last step, or a stop), with the
  straggler report read after the last step in k's record.
- ``record_divergence``: a run stopped by a persistent anomaly or a non-finite loss keeps its
  records and its save in flight, and names the last good checkpoint.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from engine.observe.metrics import REQUIRED_KEYS
from engine.training.lr_schedule import learning_rate
from engine.training.step_record import final_straggler_report

INTERRUPTED = 130  # 128 + SIGINT: the exit code of a run stopped by Ctrl-C


def say_notes(is_main: bool, notes) -> None:
    """One plain line per note on stderr, by rank 0 only."""
    if is_main:
        for note in notes:
            print(f"gridtron: note: {note}", file=sys.stderr, flush=True)


def install_stop_handlers(trainer) -> dict:
    """SIGTERM and SIGINT set ``trainer.stop_signal`` (SIGINT wins over an earlier SIGTERM): the
    run finishes its step, waits for a save in flight (joining its writer thread), saves (with
    --save) and returns cleanly. A second SIGINT leaves at once (exit 130) without waiting:
    ``latest`` still names the last published checkpoint. Returns the previous handlers, to
    restore (none off the main thread, where none can be installed)."""
    trainer.stop_signal = None
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame):
        if signum == signal.SIGINT and trainer.stop_signal == signal.SIGINT:
            if trainer.is_main:
                print(f"gridtron: stopped by a second SIGINT during step "
                      f"{trainer.stepper.current_step}, without waiting for it or a save in "
                      f"flight; latest checkpoint: {trainer.last_checkpoint() or 'none saved'}",
                      file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(INTERRUPTED)
        if trainer.stop_signal is None or signum == signal.SIGINT:
            trainer.stop_signal = signum
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        old = signal.signal(signum, on_signal)
        previous[signum] = signal.SIG_DFL if old is None else old  # None: set outside Python
    return previous


def restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def records_before_publish(trainer, outputs, step: int, blocking_s: float | None,
                           ending: bool = False) -> None:
    """The metrics records of steps up to ``step`` written (to ``outputs``: the metrics log, the
    dashboards and the run's record list) and fsynced, before checkpoint ``step`` becomes
    ``latest``: a run that dies after the publication and resumes from it finds every record up
    to it. A record not yet complete (the save of the step just trained) is completed first: one
    more wait, and with a pipeline a collective (every rank calls this); its ``save_blocking_s``
    is ``blocking_s``, the time its boundary spent on the save so far. When the run ends at
    ``step`` (``ending``: the checkpointer's save of its last step, or of a stop), the intervals
    it ends on are read first
    (``final_straggler_report``), as they are after the last step of a run without a save:
    otherwise that report would come after its record had been written."""
    log, dash, records = outputs
    if any(pending[0] < step for pending in trainer.late_records.pending):  # 0-based steps
        trainer.flush()
    taken = trainer.late_records.take()
    if ending and taken and taken[-1]["step"] == step:
        final_straggler_report(trainer, taken, log)  # (every rank: the same records, agreed stops)
    for record in taken:
        if record["step"] == step:
            record.setdefault("save_blocking_s", blocking_s)
        log.log(record)
        dash.log(record)
        records.append(record)
    log.sync()


def record_divergence(trainer, exc, step: int, first: bool) -> None:
    """Before ``exc`` (``engine.observe.anomaly.RunDiverged``; step ``step``, 0-based) leaves
    ``train``: the records of the steps before it written, the last one's late keys filled; then
    the failing step's own (``anomaly`` and ``rerun``, or its non-finite loss; not when it is the
    run's ``first``, which leaves an earlier run's outputs as they were: a failed start); then a
    save in flight whose writers finished published, and the last good checkpoint named again.
    ``exc`` is raised on every rank from the same all-reduced sums, so the collectives here are
    entered by all."""
    log, dash, records = trainer._outputs
    trainer.flush()  # one wait; with a pipeline a collective
    trainer.late_records.write(log, dash, records)
    if not first:
        record = {**dict.fromkeys(REQUIRED_KEYS), "step": step + 1,
                  "lr": learning_rate(trainer.schedule_step, trainer.cfg.optim), **exc.record}
        log.log(record)
        dash.log(record)
        records.append(record)
    log.sync()
    if trainer.checkpointer.flight is not None:
        from engine.checkpoint import CheckpointError
        try:
            trainer.checkpointer.wait()  # join, agree (one all-reduce), publish
        except CheckpointError as err:  # latest still names the checkpoint before it
            exc.why += f" (and the save in flight failed: {err})"
    exc.name_checkpoint(trainer.last_checkpoint())
