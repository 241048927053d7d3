"""Learning rate: linear warmup, then cosine (or linear) decay to min_lr at train_iters."""
from __future__ import annotations

import math

from engine.config import OptimConfig


def learning_rate(step: int, cfg: OptimConfig) -> float:
    """LR for 0-based optimizer step ``step``."""
    if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    span = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    progress = min(1.0, (step - cfg.lr_warmup_iters) / span)
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
