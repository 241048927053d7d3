"""Loss scaling for mixed precision, and the gradient checks between backward and the update.

fp16 gradients underflow unless the loss is multiplied by a large factor before backward; the
dynamic scaler keeps that factor as large as possible: it grows after ``growth_interval`` clean
steps and backs off when gradients overflow. As in Megatron-LM, ``hysteresis`` tolerates that many
overflows before backing off (the counter is restored whenever the scale grows); every overflowing
step is skipped regardless. bf16 and fp32 use ``ConstantScaler`` (scale 1): they do not underflow,
but a non-finite gradient still skips the step rather than poison the weights.

Order within one step (``unscale_and_check`` does the middle part)::

    (loss * scaler.scale).backward()  ->  reducer.finish()
    ->  found_inf over the world  ->  scaler.update  ->  skip, or unscale + clip  ->  optimizer.step(lr)
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import ClassVar


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


def unscale_and_check(optimizer, scaler, clip_grad: float = 0.0, reducer=None) -> StepCheck:
    """Overflow check over the world, scaler update, then unscale and clip unless skipped.

    ``optimizer`` is a parallel.dp optimizer (its grad_pieces, found_inf, unscale_ and
    clip_grad_norm know whether gradients are ZeRO shards). ``clip_grad <= 0`` measures the norm
    without clipping. With a ``reducer`` whose compressors keep error-feedback residuals, those are
    dropped after a skipped step and rescaled when the loss scale grows.
    """
    scale = scaler.scale
    if getattr(scaler, "constant", False) and scale == 1.0:
        # fp32/bf16: no separate overflow pass. The global grad norm is reduced over the whole
        # grid anyway, so a non-finite norm is the same decision on every rank; clipping a
        # non-finite gradient is harmless because the step is then skipped.
        norm = optimizer.clip_grad_norm(clip_grad)
        if scaler.update(not math.isfinite(norm)):
            return StepCheck(True, None, scale)
        return StepCheck(False, norm, scale)
    skipped = scaler.update(optimizer.found_inf())
    if reducer is not None:
        if skipped:
            reducer.reset_residuals()
        elif scaler.scale != scale:
            reducer.rescale_residuals(scaler.scale / scale)
    if skipped:
        return StepCheck(True, None, scale)
    if scale != 1.0:
        optimizer.unscale_(1.0 / scale)
    return StepCheck(False, optimizer.clip_grad_norm(clip_grad), scale)
