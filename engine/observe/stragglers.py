"""Stragglers, named: a rank slower than its peers doing the same work, against the time it
waited for them.

A collective cannot complete before its last member has entered it, so the time a rank spends
blocked in the communication layer (inside a synchronous collective, in ``wait()`` on the handle
of an asynchronous one such as a DP bucket, in the pipeline's receives; parallel/runtime/comm.py
records these spans) is the time it waited for its peers plus the transfer itself. The rest of its
step is its own work, "compute" below: forward, backward, optimizer, data and host overhead. A slow
rank computes longer and waits less; its peers wait for it::

    rank 0:  |== compute 0.20 ==|........ waits 0.30 for rank 1 ........|== reduce ==|
    rank 1:  |================ compute 0.50 =================|. 0.00 .|== reduce ==|

Ranks only compare with their peers: the ranks of the same role (``peer_roles``), which run the
same layers on equal shares of the batch. The role is the set of virtual pipeline stages a rank's
chunks hold: the last stage (output layer and loss) and the first (embedding) do more work than
the middle ones, and under zb-v's V placement pipeline rank 0 holds both the first and the last
stage, so comparing across stages would name a healthy end stage at every interval. A rank is a
straggler when its compute exceeds the lower median of its peers' compute by more than the
threshold (``--straggler-threshold``, default 1.2); a rank without a peer (dp = tp = cp = 1 in its
stage) is compared with nobody.

Every ``--log-interval`` steps the ranks exchange their sums over the interval (the first step a
process runs, its warm-up, left out) with one small all-gather (fp32, ``WIDTH`` values per rank; no
other collective is added to any step) and every rank computes the same report. Nothing of it waits
for the device (a step waits once, engine/device/syncs.py): a step's stamps are complete only after
the next step's wait, so an interval ending at step N is closed at step N, its last step is added
after step N + 1's wait and its all-gather is issued then (between steps N + 1 and N + 2, with a
non-blocking copy of the result to pinned host memory behind it), and the result is read after
step N + 2's wait, at the first interval step from there: the report of steps a..N lands in the
record of step N + L (``--log-interval`` L >= 2: one interval late) or N + 2 (L = 1), with the
same content it would have had at step N. The intervals a run ends on (the last one; with L = 1 the
last two) are read after the last step (``finish``: one wait, outside the steps), said in the
line, and in the last step's record where that record holds no other report. Its keys, in every
interval's record (null in the first interval's, whose report is not in yet):

- ``straggler_rank``: the straggler with the largest ratio, or null when no rank passed the
  threshold;
- ``straggler_ratio``: the largest ratio of any rank's compute over its peers' (also when it is
  below the threshold, so the figure can be watched); null when no rank has a peer;
- ``straggler_waited_for``: the rank blocked least in collectives, the one the others waited for.

The blocked time is broken down by traffic kind in the printed line, which appears only when a
straggler is found: tp, cp, pp, dp (the DP and DP x CP groups, and the expert-data-parallel group
of the expert gradients and ZeRO's expert gathers), ep (the MoE dispatch's expert-parallel group),
and other (the rest: world, mp, embedding).

Clock: anything with ``stamp()`` and ``elapsed_s(start, end)``. On the CPU, where gloo blocks the
calling thread until its collective completes, host stamps (``parallel.pipeline.executor.HostClock``,
perf_counter). On CUDA/NPU the host returns from a collective before the device has waited for
it: there the clock must stamp the device's stream (engine/device/clock.py's DeviceClock, events
read after a later step's wait), so a span is the time the stream was blocked.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from collections.abc import Callable, Hashable

import torch

from engine.config.schema import LogConfig
from engine.observe.metrics import WARMUP_STEPS
from parallel.pipeline.executor import HostClock
from parallel.pipeline.partition import placement_stages
from parallel.runtime import streams
from parallel.runtime.comm_monitor import group_kind

CATEGORIES = ("tp", "cp", "pp", "dp", "ep", "other")
WIDTH = 1 + len(CATEGORIES)      # compute seconds, then blocked seconds per category
# group kinds (parallel/runtime/comm_monitor.py GROUP_KINDS) -> category; the rest is "other".
# The expert gradients' reduction and ZeRO's expert gathers go over the expert-data-parallel
# group (kind edp): data-parallel traffic; the expert dispatch over the expert-parallel one (ep)
_CATEGORY = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "dp_cp": "dp", "edp": "dp",
             "ep": "ep"}
DEFAULT_THRESHOLD = LogConfig.straggler_threshold
Role = tuple  # ((name, value), ...): ranks with equal roles are peers


def peer_roles(grid, chunks_per_rank: int = 1, placement: str = "loop",
               extra: Callable[[int], tuple] | None = None) -> list[Role]:
    """Each rank's role, in rank order: ``(("stages", the virtual stages of its chunks),)``
    (parallel.pipeline.partition.placement_stages: with Megatron's loop placement rank r holds r,
    r + p, ...; with zb-v's V placement r and 2p - 1 - r). ``extra(rank)`` adds more
    ``(name, value)`` pairs for work that differs inside a stage: the hook for MoE expert
    parallelism, whose ranks of one stage hold different experts."""
    roles = []
    for rank in range(grid.world_size):
        stages = placement_stages(grid.pp, chunks_per_rank, grid.coord(rank).pp, placement)
        roles.append((("stages", tuple(stages)),) + (tuple(extra(rank)) if extra else ()))
    return roles


def peer_ratios(compute: list[float], roles: list[Hashable]) -> list[float | None]:
    """Each rank's compute over the lower median of its peers' (the other ranks of its role; with
    one peer, that peer's). None for a rank without peers, or whose peers computed for no time."""
    ratios = []
    for r, role in enumerate(roles):
        peers = [compute[q] for q, other in enumerate(roles) if other == role and q != r]
        median = statistics.median_low(peers) if peers else 0.0
        ratios.append(compute[r] / median if median > 0 else None)
    return ratios


def describe_role(role: Role) -> str:
    parts = []
    for name, value in role:
        if name == "stages":
            parts.append(("pipeline stage " if len(value) == 1 else "pipeline stages ")
                         + ", ".join(map(str, value)))
        else:
            parts.append(f"{name} {value}")
    return ", ".join(parts)


@dataclass
class StragglerReport:
    steps: tuple[int, int]          # first and last step of the interval (1-based)
    compute_s: list[float]          # per rank: step time not blocked in collectives
    blocked_s: list[list[float]]    # per rank: blocked seconds per CATEGORIES entry
    roles: list                     # per rank: its role (ranks of equal roles are peers)
    ratios: list                    # per rank: compute over its peers' (None without peers)
    threshold: float
    waited_for: int                 # the rank blocked least: the one the others waited for
    stragglers: list[int] = field(default_factory=list)  # past the threshold, largest ratio first

    @classmethod
    def from_rows(cls, steps, rows: list[list[float]], roles: list | None = None,
                  threshold: float = DEFAULT_THRESHOLD) -> "StragglerReport":
        """``rows``: per rank [compute, blocked per category]; ``roles``: per rank (default: every
        rank one role, all peers)."""
        if not threshold > 1.0:
            raise ValueError(f"straggler threshold must be above 1.0, got {threshold}")
        compute = [r[0] for r in rows]
        blocked = [list(r[1:]) for r in rows]
        roles = list(roles) if roles is not None else [()] * len(rows)
        if len(roles) != len(rows):
            raise ValueError(f"{len(rows)} ranks reported but {len(roles)} roles given")
        ratios = peer_ratios(compute, roles)
        found = sorted((r for r, x in enumerate(ratios) if x is not None and x > threshold),
                       key=lambda r: (-ratios[r], r))
        waited_for = min(range(len(rows)), key=lambda r: (sum(blocked[r]), r))
        return cls(steps, compute, blocked, roles, ratios, threshold, waited_for, found)

    @property
    def found(self) -> bool:
        return bool(self.stragglers)

    @property
    def straggler_rank(self) -> int | None:
        return self.stragglers[0] if self.stragglers else None

    @property
    def straggler_ratio(self) -> float | None:
        known = [x for x in self.ratios if x is not None]
        return max(known) if known else None

    def metrics(self) -> dict:
        return {"straggler_rank": self.straggler_rank, "straggler_ratio": self.straggler_ratio,
                "straggler_waited_for": self.waited_for}

    def describe(self, grid=None) -> str:
        """One line naming every straggler, its peers and whom the others waited for."""
        def who(r):
            if grid is None:
                return f"rank {r}"
            c = grid.coord(r)
            cp = f", cp {c.cp}" if grid.cp > 1 else ""
            return f"rank {r} (tp {c.tp}{cp}, pp {c.pp}, dp {c.dp})"
        named = []
        for r in self.stragglers:
            peers = [q for q, role in enumerate(self.roles) if role == self.roles[r] and q != r]
            median = statistics.median_low([self.compute_s[q] for q in peers])
            shown = ", ".join(map(str, peers[:4])) + (", ..." if len(peers) > 4 else "")
            role = describe_role(self.roles[r])
            named.append(f"{who(r)} computed {self.compute_s[r]:.3f} s, {self.ratios[r]:.2f}x the "
                         f"{median:.3f} s of its peers (rank{'s' if len(peers) > 1 else ''} {shown}"
                         + (f": {role}" if role else "") + ")")
        waits = sorted(sum(b) for b in self.blocked_s)
        w = self.waited_for
        kinds = ", ".join(f"{k} {v:.3f} s" for k, v in
                          zip(CATEGORIES, [statistics.median_low(col) for col in zip(*self.blocked_s)])
                          if v > 0)
        return (f"stragglers, steps {self.steps[0]}-{self.steps[1]} (past --straggler-threshold "
                f"{self.threshold:g}x): " + "; ".join(named) + f"; the others waited for {who(w)} "
                f"(it waited {sum(self.blocked_s[w]):.3f} s, the median rank "
                f"{statistics.median_low(waits):.3f} s" + (f": {kinds}" if kinds else "") + ")")


class StragglerMonitor:
    """Per-step sums of compute and blocked time on this rank, and the interval's report, read
    without a wait of its own (engine/device/syncs.py): a step's stamps are added after the next
    step's wait, an interval's all-gather is issued once its last step is added (``end_step`` of
    the step after it) and read by the first ``report`` after a later step's wait. ``roles``:
    every rank's role (``peer_roles``; default: its pipeline stage)."""

    def __init__(self, ps, clock=None, roles: list | None = None,
                 threshold: float = DEFAULT_THRESHOLD):
        self.ps = ps
        self.clock = clock or HostClock()
        self.roles = roles if roles is not None else peer_roles(ps.grid)
        if len(self.roles) != ps.world_size:
            raise ValueError(f"StragglerMonitor: {len(self.roles)} roles for {ps.world_size} ranks")
        self.threshold = threshold
        self.last_report: StragglerReport | None = None  # the latest read, on every rank
        self.activity = ps.comm.activity
        self.activity.clock = self.clock
        self._open = _Sums()       # the interval being summed
        self._closing = None       # an interval closed by ``report``: its last step still pending
        self._in_flight = []       # _Exchange: all-gathers issued, not read yet (oldest first)
        self._t0, self._step = None, None
        self._pending = None  # the last step's (start, end, blocked spans), read after a later wait
        self._steps_seen, self._counting = 0, False

    def begin_step(self, step: int) -> None:
        """Before step ``step`` (1-based) starts: spans recorded since (validation, saves, the
        previous interval's all-gather) are dropped. The first ``WARMUP_STEPS`` steps this process
        runs are not counted: lazy initialisation and allocator growth differ between ranks by
        more than any threshold."""
        self.activity.spans.clear()
        self.activity.step = self._step = step
        self._steps_seen += 1
        self._counting = self._steps_seen > WARMUP_STEPS
        if self._counting and self._open.first_step is None:
            self._open.first_step = step
        self._t0 = self.clock.stamp()

    def end_step(self) -> None:
        """After the step (after its wait): keep its stamps; the previous step's, complete since
        this step's wait, are added now (no wait). When they were the last of an interval
        ``report`` closed, that interval's all-gather is issued (read by a later ``report``)."""
        previous, self._pending = self._pending, None
        if self._counting:
            self._pending = (self._t0, self.clock.stamp(), list(self.activity.spans))
        self.activity.spans.clear()
        if self._closing is not None:  # ``previous`` is its last step
            closing, self._closing = self._closing, None
            self._add(previous, closing)
            self._exchange(closing)
        else:
            self._add(previous, self._open)

    def _add(self, kept, sums: "_Sums") -> None:
        """Add a kept step's compute and blocked times to ``sums`` (the clock counts a wait if
        the device has not reached its stamps yet: never, after a later step's wait)."""
        if kept is None:
            return
        start, end, spans = kept
        total = self.clock.elapsed_s(start, end)
        blocked = 0.0
        for kind, a, b in spans:
            dt = self.clock.elapsed_s(a, b)
            sums.blocked[_CATEGORY.get(group_kind(kind), "other")] += dt
            blocked += dt
        sums.compute += max(0.0, total - blocked)

    def _exchange(self, sums: "_Sums") -> None:
        """Issue the interval's all-gather (every rank at the same step) and queue its copy to the
        host behind it, on the stream; a stamp after the copy says when it may be read."""
        device = self.ps.device
        row = [sums.compute, *(sums.blocked[k] for k in CATEGORIES)]
        mine = streams.to_device(torch.tensor(row, dtype=torch.float32), device)
        out = torch.empty(self.ps.world_size * WIDTH, dtype=torch.float32, device=device)
        self.ps.world_group.all_gather_into(out, mine)
        host = out
        if out.device.type not in ("cpu", "meta"):  # pinned, non-blocking: no wait here
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
        self._in_flight.append(_Exchange((sums.first_step, sums.last_step), host,
                                         self.clock.stamp(), self._step))
        self.activity.spans.clear()  # the gather's own span

    def report(self, step: int) -> StragglerReport | None:
        """At interval step ``step`` (every rank calls it at the same steps, after the step's
        wait): close the interval ending here and return the newest earlier interval whose
        all-gather has been read, or None (none read yet: the first interval, a single rank, an
        interval of warm-up steps only). The gather of an interval ending at step N is issued at
        step N + 1 and read from step N + 2 on: with ``--log-interval`` L >= 2 at step N + L (one
        interval late), with L = 1 at step N + 2."""
        report = self._read(lambda done: done.issued < step)  # a wait since: complete
        if self.ps.world_size > 1 and self._open.first_step is not None:
            self._open.last_step = step
            self._closing = self._open  # its last step (this one) is added at the next end_step
        self._open = _Sums()
        return report

    def finish(self) -> StragglerReport | None:
        """After the last step, outside any step (every rank, at the same point): the intervals
        still in flight, the one closed at the last step included, read now at the cost of a
        wait after the steps; returns the newest, or None (nothing left, a single rank)."""
        if self._closing is not None:      # its last step is the run's last: add it, exchange
            closing, self._closing = self._closing, None
            last, self._pending = self._pending, None
            self._add(last, closing)
            self._exchange(closing)
        return self._read(lambda done: True)   # (a wait, counted: outside the steps)

    def _read(self, ready) -> StragglerReport | None:
        """Read the all-gathers in flight, oldest first, while ``ready(exchange)``; the newest
        read becomes ``last_report`` and is returned (None: none read)."""
        report = None
        while self._in_flight and ready(self._in_flight[0]):
            done = self._in_flight.pop(0)
            self.clock.elapsed_s(done.stamp, done.stamp)  # (counted if it were not complete)
            rows = done.host.view(self.ps.world_size, WIDTH).tolist()
            report = StragglerReport.from_rows(done.steps, rows, self.roles, self.threshold)
        if report is not None:
            self.last_report = report
        return report


@dataclass
class _Sums:
    """One interval's sums on this rank: compute seconds, blocked seconds per category."""
    compute: float = 0.0
    blocked: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    first_step: int | None = None
    last_step: int | None = None


@dataclass
class _Exchange:
    """An interval's all-gather in flight: its steps, the host copy of every rank's row, a stamp
    after the copy, and the step at whose end it was issued."""
    steps: tuple
    host: torch.Tensor
    stamp: object
    issued: int
