"""``--profile-steps A-B``: hand optimizer steps A..B (1-based, inclusive) to the PyTorch profiler.

Every rank records its own trace with operator shapes and memory (``record_shapes``,
``profile_memory``) and writes it to ``--profile-dir`` (default ``<run-dir>/profile``) through the
profiler's ``tensorboard_trace_handler``: ``rank<R>.<timestamp>.pt.trace.json`` from torch.profiler
(CPU and CUDA activities), which Perfetto and TensorBoard open; on Ascend, torch_npu.profiler's
counterpart writes its ``rank<R>_...`` folder (CPU and NPU activities) in the same place. Nothing
op-level is recorded by hand; the engine's own step timeline is ``--timeline``.
"""
from __future__ import annotations

import os

from engine.config.schema import parse_steps
from engine.device.runtime import profiler_api


class StepProfiler:
    """Starts the profiler before step A and stops it (writing the trace) after step B."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: str, kind: str = "cpu", rank: int = 0):
        self.steps, self.out_dir, self.kind, self.rank = steps, out_dir, kind, rank
        self._prof = None
        self.written: str | None = None

    @classmethod
    def from_config(cls, log, kind: str, rank: int) -> "StepProfiler":
        steps = parse_steps(log.profile_steps)
        out = log.profile_dir or os.path.join(log.compile_cache_root, "profile")
        return cls(steps, out, kind, rank)

    def before_step(self, step: int) -> None:
        if self.steps is None or self._prof is not None or self.written is not None \
                or not self.steps[0] <= step <= self.steps[1]:  # (a resumed run may start inside)
            return
        profile, activities, handler = profiler_api(self.kind)
        os.makedirs(self.out_dir, exist_ok=True)
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                             on_trace_ready=handler(self.out_dir, worker_name=f"rank{self.rank}"))
        self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is None or step < self.steps[1]:
            return
        self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends before step B)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.written = self.out_dir
