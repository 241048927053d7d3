"""Test helper launched by torchrun: ``python -m engine.train`` whose rank dies once at a chosen step.

GRIDTRON_TEST_CRASH="STEP:RANK:MARKER": when global rank RANK is about to run 0-based step STEP
and the file MARKER does not exist yet, it creates MARKER and exits at once (os._exit, as a killed
worker would), so the job dies once and its restart runs normally. Read here, never in engine code.
"""
import os
import sys

import engine.train
from engine.trainer import Trainer


def main() -> int:
    spec = os.environ.get("GRIDTRON_TEST_CRASH")
    if spec:
        step, rank, marker = spec.split(":", 2)
        real = Trainer.train_one

        def train_one(self, s):
            if s == int(step) and self.ps.rank == int(rank) and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(17)
            return real(self, s)

        Trainer.train_one = train_one
    return engine.train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
