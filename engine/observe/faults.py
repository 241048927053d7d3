"""Faults to inject into a Trainer, for tests and drills: a NaN in one rank's gradient, a slow rank, a
hung rank. Each is an object the caller installs on a built trainer (``fault.install(trainer)``);
the hooks live on the trainer's modules and parameters, never in model code, and do nothing on the
other ranks.

    GradFault(rank=1, step=3, param="layers.1.mlp.fc2.weight", micro_batch=0).install(trainer)
    SlowRank(rank=1, seconds=0.3).install(trainer)        # a sleep before each forward
    HangRank(rank=1, step=2, release="/tmp/x").install(trainer)
"""
from __future__ import annotations

import os
import time


class Released(RuntimeError):
    """Raised by a HangRank once released: the hung rank leaves its step."""


def _stepper_step(trainer) -> int | None:
    return trainer.stepper.current_step


class GradFault:
    """A NaN planted in element 0 of one parameter's gradient (by logical name) on ``rank``, in
    micro-batch ``micro_batch`` of step ``step`` (1-based), before it is accumulated. Transient
    (only the step's first execution) unless ``repeat`` (every execution: a re-run sees it again).
    Under a zero-bubble schedule a weight whose gradient waits for the W action is reached once W
    has accumulated that micro-batch's gradient: ``value`` is added to its element 0 there."""

    def __init__(self, rank: int, step: int, param: str, micro_batch: int = 0, repeat: bool = False,
                 value: float = float("nan")):
        self.rank, self.step, self.param, self.micro_batch = rank, step, param, micro_batch
        self.repeat, self.value = repeat, value
        self.planted = 0
        self._step, self._calls = None, 0

    def install(self, trainer) -> "GradFault":
        if trainer.ps.rank != self.rank:
            return self
        named = {n: p for c in trainer.chunks for n, p in c.logical_named_parameters()}
        if self.param not in named:
            raise ValueError(f"GradFault: rank {self.rank} holds no parameter {self.param!r}; it "
                             f"holds {sorted(named)}")
        self.trainer, self.num_micro, self.target = trainer, trainer.num_micro, named[self.param]
        self.target.register_hook(self._hook)
        store = getattr(trainer, "weight_grads", None)   # the B/W split's (zb-h1, zb-v)
        if store is not None:
            store.accumulated_hooks.append(self._after_w)
        return self

    def _due(self, micro: int | None = None) -> bool:
        """Whether this gradient (the next of the step's: one per micro-batch and execution) is
        the one to plant into; ``micro``: its micro-batch when the caller knows it."""
        step = _stepper_step(self.trainer)
        if step != self._step:
            self._step, self._calls = step, 0
        execution, counted = divmod(self._calls, self.num_micro)
        self._calls += 1
        micro = counted if micro is None else micro
        if step != self.step or micro != self.micro_batch or (execution and not self.repeat):
            return False
        self.planted += 1
        return True

    def _hook(self, grad):
        if grad is None or not self._due():  # None: left to a W action (``_after_w``)
            return None
        grad = grad.clone()
        grad.view(-1)[0] = self.value
        return grad

    def _after_w(self, key, param) -> None:
        if param is not self.target or not self._due(key[0]):  # key: (micro-batch, chunk)
            return
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        grad.view(-1)[0] += self.value


class SlowRank:
    """``seconds`` of sleep before every forward of the rank's first model chunk."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def install(self, trainer) -> "SlowRank":
        if trainer.ps.rank == self.rank:
            trainer.chunks[0].register_forward_pre_hook(lambda module, args: time.sleep(self.seconds))
        return self


class HangRank:
    """The rank's first forward of step ``step`` blocks (outside any collective) until the file
    ``release`` exists or ``limit_s`` passed, then raises ``Released``."""

    def __init__(self, rank: int, step: int, release: str, limit_s: float = 120.0):
        self.rank, self.step, self.release, self.limit_s = rank, step, release, limit_s

    def install(self, trainer) -> "HangRank":
        if trainer.ps.rank == self.rank:
            self.trainer = trainer
            trainer.chunks[0].register_forward_pre_hook(self._hook)
        return self

    def _hook(self, module, args):
        if _stepper_step(self.trainer) != self.step:
            return
        deadline = time.monotonic() + self.limit_s
        while not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise Released(f"rank {self.rank} released from its hang in step {self.step}")
