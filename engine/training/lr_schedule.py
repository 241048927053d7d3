"""Learning rate: linear warmup, then cosine (or linear) decay to min_lr at lr_decay_iters (default
train_iters), constant at min_lr after it."""
from __future__ import annotations

import math

from engine.config.schema import OptimConfig


def learning_rate(step: int, cfg: OptimConfig) -> float:
    """LR for 0-based optimizer step ``step``."""
    if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
        return cfg.lr * (step + 1) / cfg.lr_warmup_iters
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_end = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else cfg.train_iters
    span = max(1, decay_end - cfg.lr_warmup_iters)
    progress = min(1.0, (step - cfg.lr_warmup_iters) / span)
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
