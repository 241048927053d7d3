"""Test helper launched by torchrun or plain python: ``python -m engine.train`` with faults injected.

GRIDTRON_TEST_CRASH="STEP:RANK:MARKER": when global rank RANK is about to run 0-based step STEP
and the file MARKER does not exist yet, it creates MARKER and exits at once (os._exit, as a killed
worker would), so the job dies once and its restart runs normally.

GRIDTRON_TEST_BLOCK_SAVE="STEP:MARKER[:RELEASE]": the background writer (--async-save) of the save
of step STEP writes its first file (the safetensors shard), creates MARKER and then blocks, until
the file RELEASE exists (forever without RELEASE: the test kills the process mid-write).

GRIDTRON_TEST_RANK_ARGS='{"RANK": [ARG, ...]}': arguments that global rank RANK (RANK, or
SLURM_PROCID) adds to the command line, e.g. ranks of one torchrun job started with different flags.

Read here, never in engine code.
"""
import json
import os
import sys
import threading
import time

import engine.checkpoint.writer as writer
import engine.training.launch as launch
from engine.training.trainer import Trainer


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
    block = os.environ.get("GRIDTRON_TEST_BLOCK_SAVE")
    if block:
        step, marker, *release = block.split(":")
        real_write = writer.write_shard

        def write_shard(tensors, path):
            info = real_write(tensors, path)
            if threading.current_thread() is not threading.main_thread() and \
                    f"iter_{int(step):07d}.tmp" in path:
                open(marker, "w").close()
                while not (release and os.path.exists(release[0])):
                    time.sleep(0.05)
            return info

        writer.write_shard = write_shard
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    extra = json.loads(os.environ.get("GRIDTRON_TEST_RANK_ARGS", "{}")).get(rank, [])
    return launch.main(sys.argv[1:] + extra)


if __name__ == "__main__":
    launch.exit_now(main())
