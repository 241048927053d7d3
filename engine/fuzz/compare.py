"""One case against its serial reference: the verdict, in one line.

The serial reference of a model key is trained once, in this process, by the same trainer with
tp = cp = pp = dp = 1 and one micro-batch of the whole global batch (docs/design.md: any split
trains the same model). A case passes when no rank failed, no rank's stream checker recorded a
violation, every two ranks submitted to the communicators they share in the same order, and on
every rank the per-step loss and gradient norm, and the validation loss of the last step, agree
with the serial run to docs/design.md's relative 1e-4.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.fuzz.space import Case
from parallel.runtime.lanes import order_mismatch

REL = 1e-4


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
            "valid": [loss for _, loss in result.valid]}


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


def _off(key: str, where: str, g: float, w: float) -> str | None:
    if abs(g - w) <= REL * abs(w):
        return None
    return (f"{key} differs at {where}: {g:.7g} vs serial {w:.7g} "
            f"(relative {abs(g - w) / max(abs(w), 1e-30):.2g} > {REL:g})")


def judge(ranks: list[dict], serial: dict) -> Verdict:
    """The case's verdict from every rank's result (``pool.train_checked``) and the serial run."""
    for rank, out in enumerate(ranks):
        if "error" in out:
            last = out["error"].strip().splitlines()[-1]
            return Verdict(False, f"rank {rank} failed: {last}")
    for rank, out in enumerate(ranks):
        if out["violations"]:
            return Verdict(False, f"rank {rank}: {len(out['violations'])} stream-order "
                                  f"violation(s), the first: {out['violations'][0]}")
    mismatch = order_mismatch({rank: out["order"] for rank, out in enumerate(ranks)})
    if mismatch:
        return Verdict(False, mismatch)
    for rank, out in enumerate(ranks):
        why = _differs(out, serial)
        if why:
            return Verdict(False, f"rank {rank}: {why}")
    return Verdict(True)
