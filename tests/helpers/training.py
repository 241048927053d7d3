"""One training run in this process, for tests that read its per-step records."""
from __future__ import annotations

from engine.config.cli import parse_args
from engine.training.trainer import Trainer


def train_records(argv: list[str], cls=Trainer) -> list[dict]:
    """The records of a run of ``cls`` (a Trainer or a subclass that plants a fault) on the
    command line ``argv``; the trainer is closed however the run ends."""
    trainer = cls(parse_args(argv))
    try:
        return trainer.train().records
    finally:
        trainer.close()
