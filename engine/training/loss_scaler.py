"""Loss scaling for mixed precision, and the gradient checks between backward and the update.

fp16 gradients underflow unless the loss is multiplied by a large factor before backward; the
dynamic scaler keeps that factor as large as possible: it grows after ``growth_interval`` clean
steps and backs off when gradients overflow. As in Megatron-LM, ``hysteresis`` tolerates that many
overflows before backing off (the counter is restored whenever the scale grows); every overflowing
step is skipped regardless. bf16 and fp32 use ``ConstantScaler`` (scale 1): they do not underflow,
but a non-finite gradient still skips the step rather than poison the weights.

Order within one step::

    overflow.clear()  ->  (loss * scaler.scale).backward()  ->  reducer.finish()
    ->  grad_stats: unscale + this rank's overflow flag in one pass, the float status register on
        saturation-mode NPUs, the squared global norm (all on the device)
    ->  the step's one grid-wide reduction and host read (engine/training/step.py, with the loss)
    ->  apply_grad_stats: scaler.update, skip or clip  ->  optimizer.step(lr)

``unscale_and_check`` runs the three parts with a reduction of its own, for callers outside the
step. Unscaling happens before the skip decision: a skipped step's gradients are discarded anyway.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from parallel.grads.norm import clip_coefficient


@dataclass
class DynamicLossScaler:
    constant: ClassVar[bool] = False
    init_scale: float = 1024.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    scale: float = field(init=False)
    _growth_tracker: int = field(init=False, default=0)
    _hysteresis_tracker: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        checks = [
            (self.init_scale > 0, f"init_scale must be positive, got {self.init_scale} (--initial-loss-scale)"),
            (self.growth_factor > 1, f"growth_factor must be > 1, got {self.growth_factor}"),
            (0 < self.backoff_factor < 1, f"backoff_factor must be in (0, 1), got {self.backoff_factor}"),
            (self.growth_interval >= 1,
             f"growth_interval must be >= 1, got {self.growth_interval} (--loss-scale-window)"),
            (self.hysteresis >= 1, f"hysteresis must be >= 1, got {self.hysteresis} (--hysteresis)"),
            (0 < self.min_scale <= self.init_scale,
             f"min_scale must be in (0, init_scale={self.init_scale}], got {self.min_scale}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DynamicLossScaler: {message}")
        self.scale = float(self.init_scale)
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> bool:
        """Account for one step's overflow status; return True when the step must be skipped."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return True
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


@dataclass
class ConstantScaler:
    constant: ClassVar[bool] = True
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"ConstantScaler: scale must be positive, got {self.scale}")

    def update(self, found_inf: bool) -> bool:
        return bool(found_inf)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class StepCheck:
    skipped: bool
    grad_norm: float | None      # None on a skipped step
    loss_scale: float            # the scale this step's loss was multiplied by


def grad_stats(optimizer, scaler, overflow=None, share: bool = False) -> torch.Tensor:
    """The step's gradient statistics, on the device and before any host read: a (2,) fp32
    tensor [this rank's overflow flag, squared global gradient norm (equal on every rank)], or
    with ``share`` [flag, this rank's share of the squared norm], to be summed over the world by
    the step's statistics all-reduce (one collective fewer).

    ``optimizer`` is a parallel.dp optimizer (its helpers know whether gradients are ZeRO shards).
    With a dynamic scale the gradients are unscaled and checked for inf/nan in one multi-tensor
    pass; with a constant scale of 1 (fp32, bf16) there is no separate pass: a non-finite norm is
    the same signal. ``overflow`` (the device module's ``overflow_check()``) adds the float status
    register of a saturation-mode NPU, where an overflow leaves the gradients finite.
    """
    scale = scaler.scale
    found = None
    if not (getattr(scaler, "constant", False) and scale == 1.0):
        found = optimizer.check_and_unscale_(1.0 / scale)
    status = overflow.flag() if overflow is not None else None
    if status is not None:
        found = status.reshape(()) if found is None else torch.maximum(found, status.reshape(()))
    norm_sq = (optimizer.grad_norm_sq_share() if share else optimizer.grad_norm_sq()).reshape(())
    if found is None:
        found = torch.zeros_like(norm_sq)
    return torch.stack([found.to(torch.float32), norm_sq.to(torch.float32)])


def apply_grad_stats(optimizer, scaler, found: float, norm_sq: float, clip_grad: float = 0.0,
                     reducer=None) -> StepCheck:
    """After the host read of grid-wide statistics (``found`` > 0: some rank overflowed): scaler
    update, skip or clip. Every rank holds the same values, so every rank decides the same.

    ``clip_grad <= 0`` measures the norm without clipping. With a ``reducer`` whose compressors keep
    error-feedback residuals, a skipped step's exchanges are undone (the residuals it started from
    come back, and the reducer's step counter does not count it: ``step_skipped``), an applied
    step's are committed, and the residuals follow the loss scale when it changes (they are in
    its units). A non-finite norm skips the step too (clipping would not save it).
    """
    scale = scaler.scale
    norm = math.sqrt(norm_sq) if norm_sq >= 0 else float("nan")
    skipped = scaler.update(found > 0 or not math.isfinite(norm))
    if reducer is not None:
        if skipped:
            reducer.step_skipped()
        else:
            reducer.step_applied()
        if scaler.scale != scale:
            reducer.rescale_residuals(scaler.scale / scale)
    if skipped:
        return StepCheck(True, None, scale)
    coef = clip_coefficient(norm, clip_grad)
    if coef is not None:
        optimizer.clip_(coef)
    return StepCheck(False, norm, scale)


def unscale_and_check(optimizer, scaler, clip_grad: float = 0.0, reducer=None,
                      overflow=None) -> StepCheck:
    """``grad_stats``, the overflow flag reduced (MAX) over the world, one host read, then
    ``apply_grad_stats``: the step's checks for callers that do not batch them with the loss."""
    stats = grad_stats(optimizer, scaler, overflow)
    optimizer.ps.world_group.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
    found, norm_sq = stats.tolist()
    return apply_grad_stats(optimizer, scaler, found, norm_sq, clip_grad, reducer)
