"""``python -m engine.train``: one training job (single process, or one rank under torchrun/Slurm)."""
from __future__ import annotations

import sys

from engine.cli import ConfigError, parse_args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        print(f"gridtron: configuration error: {exc}", file=sys.stderr)
        return 2
    from engine.trainer import Trainer
    try:
        trainer = Trainer(cfg)
    except ConfigError as exc:
        print(f"gridtron: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        result = trainer.train()
        if trainer.is_main and result.summary:
            print(result.summary)
            if getattr(trainer, "sample_text", None):
                print(trainer.sample_text)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
