"""One case against its serial reference: the verdict, in one line.

The serial reference of a model key is trained once, in this process, by the same trainer with
tp = cp = pp = dp = 1 and one micro-batch of the whole global batch (docs/design.md: any split
trains the same model). A case passes when no rank failed, no rank's stream checker recorded a
violation, every two ranks submitted to the communicators they share in the same order, and on
every rank the per-step loss and gradient norm, and the validation loss of the last step, agree
with the serial run to docs/design.md's relative 1e-4.

A screening case (screen.py: bf16, fp16, FP8, dropout, a capacity factor, the global aux loss,
gradient compression) trains another model by design, so ``judge_screen`` holds it to what no
rounding excuses: what every run must get right (``ran_alike``: no rank failed, no violation, one
submission order), every rank reporting the same figures, every figure finite (only fp16's
overflow skips a step), the last step's loss and the validation loss within ``LOSS_REL`` of the
serial run's and every applied step's gradient norm within ``NORM_REL`` (under topk and onebit
the figures before the first compressed update only: ``_astray``; docs/testing.md says why these
bounds).

Worked example: ``dp=2,precision=bf16`` with a reduction that sums the replicas' gradients instead
of averaging them fails with "the gradient norm differs at step 1: 1.77977 vs serial 0.890049
(relative 1 > 0.5)", while its last loss stays within 1.1e-4 of the serial run's (Adam and the
clipping undo the gradient's scale); fp16 deciding its overflow skip on each rank alone fails
``pp=2,precision=fp16,overflow=1`` with "rank 1 skipped step 1 and rank 0 did not".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.fuzz.screen import ScreenCase
from engine.fuzz.space import Case
from parallel.runtime.lanes import order_mismatch

REL = 1e-4
LOSS_REL = 5e-2   # screening: the last step's loss and the validation loss against serial
NORM_REL = 0.5    # screening: each applied step's gradient norm against serial
SPARSE = ("topk", "onebit")   # compressors whose exchanged gradient has another norm by design


def train_serial(case: Case, steps: int) -> dict:
    from engine.config.cli import parse_args
    from engine.training.trainer import Trainer
    from parallel.grid.launch import LaunchEnv
    trainer = Trainer(parse_args(case.serial_argv(steps)), launch=LaunchEnv())
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return figures(result)


def figures(result) -> dict:
    """What a case is compared by, from a run's ``RunResult``: per-step loss and gradient norm,
    and the validation losses."""
    return {"loss": [r["loss"] for r in result.records],
            "grad_norm": [r["grad_norm"] for r in result.records],
            "valid": [loss for _, loss in result.valid],
            "skipped": [bool(r.get("skipped")) for r in result.records]}


@dataclass
class Verdict:
    ok: bool
    why: str = ""


def _differs(got: dict, want: dict) -> str | None:
    """The first step whose loss or gradient norm is off the serial run's (loss named first),
    then the first validation loss that is."""
    for key in ("loss", "grad_norm", "valid"):
        if len(got[key]) != len(want[key]):
            return f"{len(got[key])} values of {key}, the serial run has {len(want[key])}"
    for step in range(len(want["loss"])):
        for key in ("loss", "grad_norm"):
            why = _off(key, f"step {step + 1}", got[key][step], want[key][step])
            if why:
                return why
    for i, (g, w) in enumerate(zip(got["valid"], want["valid"])):
        why = _off("the validation loss", f"evaluation {i + 1}", g, w)
        if why:
            return why
    return None


def _off(key: str, where: str, g: float, w: float, rel: float = REL) -> str | None:
    if abs(g - w) <= rel * abs(w):
        return None
    return (f"{key} differs at {where}: {g:.7g} vs serial {w:.7g} "
            f"(relative {abs(g - w) / max(abs(w), 1e-30):.2g} > {rel:g})")


def ran_alike(ranks: list[dict]) -> str | None:
    """Why the ranks' runs are not even worth comparing (None: they are): a rank failed, a stream
    checker recorded a violation, or two ranks submitted to a shared communicator in different
    orders. Both verdicts start here."""
    for rank, out in enumerate(ranks):
        if "error" in out:
            last = out["error"].strip().splitlines()[-1]
            return f"rank {rank} failed: {last}"
    for rank, out in enumerate(ranks):
        if out["violations"]:
            return (f"rank {rank}: {len(out['violations'])} stream-order violation(s), the first: "
                    f"{out['violations'][0]}")
    return order_mismatch({rank: out["order"] for rank, out in enumerate(ranks)})


def judge(ranks: list[dict], serial: dict) -> Verdict:
    """The case's verdict from every rank's result (``pool.train_checked``) and the serial run."""
    why = ran_alike(ranks)
    if why:
        return Verdict(False, why)
    for rank, out in enumerate(ranks):
        why = _differs(out, serial)
        if why:
            return Verdict(False, f"rank {rank}: {why}")
    return Verdict(True)


def judge_screen(case: ScreenCase, ranks: list[dict], serial: dict) -> Verdict:
    """A screening case's verdict (module docstring) from every rank's result and the serial run
    of its model in fp32; the case's precision says whether a step may be skipped, its compressor
    how far the figures are bounded."""
    why = ran_alike(ranks) or _ranks_differ(ranks) or _not_finite(case, ranks[0]) \
        or _astray(case, ranks[0], serial)
    return Verdict(why is None, why or "")


def _ranks_differ(ranks: list[dict]) -> str | None:
    """Every figure a run reports is reduced over the grid, so each rank must hold the same: the
    first step where one does not (a skip decided alone shows here before what it causes)."""
    first = ranks[0]
    for step in range(len(first["loss"])):
        for rank, out in enumerate(ranks[1:], 1):
            skip, skip0 = out["skipped"][step], first["skipped"][step]
            if skip != skip0:
                return (f"rank {rank if skip else 0} skipped step {step + 1} and rank "
                        f"{0 if skip else rank} did not")
            for key in ("loss", "grad_norm"):
                if not _same(out[key][step], first[key][step]):
                    return (f"rank {rank} reports {key} {out[key][step]} at step {step + 1}, "
                            f"rank 0 {first[key][step]}")
    for rank, out in enumerate(ranks[1:], 1):
        if len(out["valid"]) != len(first["valid"]) or \
                not all(map(_same, out["valid"], first["valid"])):
            return f"rank {rank} reports the validation loss {out['valid']}, rank 0 {first['valid']}"
    return None


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)   # NaN on both: the same report


def _not_finite(case: ScreenCase, out: dict) -> str | None:
    """A loss or an applied step's gradient norm that is not finite, or a step skipped outside
    fp16 (a non-finite gradient there). fp16 may skip any step: its scale backs off after each
    overflow, and a short run may end before it is below what the gradients need."""
    for step, (loss, norm, skip) in enumerate(zip(out["loss"], out["grad_norm"], out["skipped"])):
        if not math.isfinite(loss):
            return f"the loss at step {step + 1} is {loss}"
        if skip and case.precision != "fp16":
            return (f"step {step + 1} was skipped in {case.precision}: its gradients were not "
                    f"finite (only fp16's loss scale overflows)")
        if not skip and not math.isfinite(norm):
            return f"the gradient norm at step {step + 1} is {norm}"
    if not all(math.isfinite(v) for v in out["valid"]):
        return f"the validation loss is {out['valid']}"
    return None


def _astray(case: ScreenCase, out: dict, serial: dict) -> str | None:
    """The losses and gradient norms against the serial run's, to the screening bounds: the last
    step's loss and the validation losses, and each applied step's gradient norm. Under topk and
    onebit, whose Adam second moment is frozen after the one warm-up step, the loss of step 2 (the
    last step whose weights only uncompressed updates made) and the first step's norm instead:
    after it the norm is a sparse or sign-coded gradient's, and the loss follows the frozen
    moment of one gradient."""
    for key in ("loss", "valid"):
        if len(out[key]) != len(serial[key]):
            return f"{len(out[key])} values of {key}, the serial run has {len(serial[key])}"
    sparse, steps = case.compression in SPARSE, len(serial["loss"])
    at = min(2, steps) if sparse else steps
    checks = [("the loss", f"step {at}", out["loss"][at - 1], serial["loss"][at - 1], LOSS_REL)]
    if not sparse:
        checks += [("the validation loss", f"evaluation {i + 1}", g, w, LOSS_REL)
                   for i, (g, w) in enumerate(zip(out["valid"], serial["valid"]))]
    checks += [("the gradient norm", f"step {i + 1}", out["grad_norm"][i], serial["grad_norm"][i],
                NORM_REL) for i in range(1 if sparse else steps) if not out["skipped"][i]]
    for key, where, g, w, rel in checks:
        why = _off(key, where, g, w, rel)
        if why:
            return why
    return None
