"""Stragglers, named: each rank's own work against the time it waited for its peers.

A collective cannot complete before its last member has entered it, so the time a rank spends
blocked in the communication layer (inside a synchronous collective, in ``wait()`` on the handle
of an asynchronous one such as a DP bucket, in the pipeline's receives; parallel/comm.py records
these spans) is the time it waited for its peers plus the transfer itself. The rest of its step is
its own work, "compute" below: forward, backward, optimizer, data and host overhead. A slow rank
computes longer and waits less; its peers wait for it::

    rank 0:  |== compute 0.20 ==|........ waits 0.30 for rank 1 ........|== reduce ==|
    rank 1:  |================ compute 0.50 =================|. 0.00 .|== reduce ==|

Every ``--log-interval`` steps the ranks exchange their sums over the interval with one small
all-gather (fp32, ``WIDTH`` values per rank; no other collective is added to any step) and every
rank computes the same report: ``straggler_rank``, the rank with the most compute,
``straggler_ratio``, its compute over the median rank's (the lower median, so that with two ranks it
is the other one), and ``straggler_waited_for``, the rank that waited least (the one its peers
waited for: it arrived last). The blocked time is broken down by traffic kind (tp, cp, pp, dp, and
the rest: world, mp, embedding).

Clock: anything with ``stamp()`` and ``elapsed_s(start, end)``. On the CPU, where gloo blocks the
calling thread until its collective completes, host stamps (``parallel.pipeline.executor.HostClock``,
perf_counter). On CUDA/NPU the host returns from a collective before the device has waited for
it: there the clock must stamp the device's stream (engine/device/clock.py's DeviceClock, events read after the step's synchronization),
so a span is the time the stream was blocked.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from parallel.pipeline.executor import HostClock

CATEGORIES = ("tp", "cp", "pp", "dp", "other")
WIDTH = 1 + len(CATEGORIES)      # compute seconds, then blocked seconds per category
_CATEGORY = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "dp_cp": "dp"}


@dataclass
class StragglerReport:
    steps: tuple[int, int]          # first and last step of the interval (1-based)
    compute_s: list[float]          # per rank: step time not blocked in collectives
    blocked_s: list[list[float]]    # per rank: blocked seconds per CATEGORIES entry
    straggler_rank: int
    straggler_ratio: float | None   # None when the median rank computed for no time at all
    waited_for: int

    @classmethod
    def from_rows(cls, steps, rows: list[list[float]]) -> "StragglerReport":
        compute = [r[0] for r in rows]
        blocked = [list(r[1:]) for r in rows]
        slow = max(range(len(rows)), key=lambda r: (compute[r], -r))
        median = statistics.median_low(compute)
        waited_for = min(range(len(rows)), key=lambda r: (sum(blocked[r]), r))
        return cls(steps, compute, blocked, slow, compute[slow] / median if median > 0 else None,
                   waited_for)

    def metrics(self) -> dict:
        return {"straggler_rank": self.straggler_rank, "straggler_ratio": self.straggler_ratio,
                "straggler_waited_for": self.waited_for}

    def describe(self, grid=None, top: int = 3) -> str:
        def who(r):
            if grid is None:
                return f"rank {r}"
            c = grid.coord(r)
            return f"rank {r} (tp {c.tp}, pp {c.pp}, dp {c.dp})"
        order = sorted(range(len(self.compute_s)), key=lambda r: -self.compute_s[r])[:top]
        slowest = ", ".join(f"{who(r)} {self.compute_s[r]:.3f} s" for r in order)
        median = statistics.median_low(self.compute_s)
        ratio = "n/a" if self.straggler_ratio is None else f"{self.straggler_ratio:.2f}x"
        waits = sorted(sum(b) for b in self.blocked_s)
        w = self.waited_for
        kinds = ", ".join(f"{k} {v:.3f} s" for k, v in
                          zip(CATEGORIES, [statistics.median_low(col) for col in zip(*self.blocked_s)])
                          if v > 0)
        return (f"stragglers, steps {self.steps[0]}-{self.steps[1]}: slowest by compute {slowest} "
                f"(median {median:.3f} s; straggler {ratio}); the others waited for {who(w)} "
                f"(it waited {sum(self.blocked_s[w]):.3f} s, the median rank "
                f"{statistics.median_low(waits):.3f} s" + (f": {kinds}" if kinds else "") + ")")


class StragglerMonitor:
    """Per-step sums of compute and blocked time on this rank, and the interval's report."""

    def __init__(self, ps, clock=None):
        self.ps = ps
        self.clock = clock or HostClock()
        self.activity = ps.comm.activity
        self.activity.clock = self.clock
        self._reset()
        self._t0 = None

    def _reset(self) -> None:
        self.compute = 0.0
        self.blocked = dict.fromkeys(CATEGORIES, 0.0)
        self.first_step = None

    def begin_step(self, step: int) -> None:
        """Before step ``step`` (1-based) starts: spans recorded since (validation, saves) are
        dropped."""
        self.activity.spans.clear()
        self.activity.step = step
        if self.first_step is None:
            self.first_step = step
        self._t0 = self.clock.stamp()

    def end_step(self) -> None:
        """After the step (the device synchronized): add its compute and blocked times."""
        end = self.clock.stamp()
        total = self.clock.elapsed_s(self._t0, end)
        blocked = 0.0
        for kind, a, b in self.activity.spans:
            dt = self.clock.elapsed_s(a, b)
            self.blocked[_CATEGORY.get(kind, "other")] += dt
            blocked += dt
        self.activity.spans.clear()
        self.compute += max(0.0, total - blocked)

    def report(self, step: int) -> StragglerReport | None:
        """One all-gather over the world (every rank calls it at the same steps); None on a
        single rank."""
        if self.ps.world_size == 1 or self.first_step is None:
            self._reset()
            return None
        mine = torch.tensor([self.compute, *(self.blocked[k] for k in CATEGORIES)],
                            dtype=torch.float32, device=self.ps.device)
        out = torch.empty(self.ps.world_size * WIDTH, dtype=torch.float32, device=self.ps.device)
        self.ps.world_group.all_gather_into(out, mine)
        rows = out.view(self.ps.world_size, WIDTH).tolist()
        report = StragglerReport.from_rows((self.first_step, step), rows)
        self._reset()
        self.activity.spans.clear()  # the gather's own span
        return report
