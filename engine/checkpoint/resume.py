"""Where a run starts: ``--load``, or the unfinished run's checkpoint in ``--save``.

A job that torchrun restarts passes the same flags again: with ``--save DIR`` alone it continues from
DIR's latest checkpoint by itself; with ``--load A --save B`` it continues from B's when that is newer
(a later step) than A's. A ``--save`` holding a finished run (its step >= ``--train-iters``) is not
resumed: the new run replaces its checkpoints, and says so.
"""
from __future__ import annotations

import os
import warnings

from engine.checkpoint.index import has_checkpoint, saved_step
from engine.checkpoint.reader import load_checkpoint


def resume(trainer) -> int:
    """Load --load; without it, resume from --save when that holds an unfinished run's
    checkpoint (so a job restarted by torchrun continues by itself). With both, a restarted
    job resumes from --save's latest when it is newer (a later step) than --load's."""
    ck = trainer.cfg.checkpoint
    same = ck.load and ck.save and os.path.realpath(ck.load) == os.path.realpath(ck.save)
    fresh = same and not has_checkpoint(ck.save)
    if ck.load and not same and has_checkpoint(ck.save):
        mine, given = saved_step(ck.save), saved_step(ck.load)
        if mine is not None and (given is None or mine > given):
            if trainer.is_main:
                print(f"gridtron: resuming from {ck.save} (step {mine}), newer than --load "
                      f"{ck.load} (step {given})", flush=True)
            return load_checkpoint(trainer, ck.save)
    if ck.load and not fresh:  # (--load DIR --save DIR on a first run starts from scratch)
        return load_checkpoint(trainer, ck.load)
    if has_checkpoint(ck.save):
        step = saved_step(ck.save)
        if step is None or step < trainer.cfg.optim.train_iters:
            if trainer.is_main:
                print(f"gridtron: resuming from {ck.save} (step {step}); pass --load to choose "
                      f"another checkpoint", flush=True)
            return load_checkpoint(trainer, ck.save)
        if trainer.is_main:
            warnings.warn(f"{ck.save} already holds a finished run (step {step} >= --train-iters "
                          f"{trainer.cfg.optim.train_iters}): starting a new run that will replace "
                          f"its checkpoints; pass --load {ck.save} to continue from it instead")
    return 0
