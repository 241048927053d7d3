"""Pipeline transfers in the bubble: each transfer's measured time, the part of it a stage's compute
waited for (``time_pp_exposed_s``), and the per-stage costs the replay takes (bubble.simulate).

The executor records two kinds of span per rank (``TransferSpan``, device time on the rank's
stream through its clock: events on CUDA/NPU, wall-clock on CPU): posting a batch of transfers,
and waiting for transfers, each naming the actions (indices into the rank's program) it covers.
A message is ready once both sides have posted it (the end of the sender's post and of the
receiver's post). A wait ``[start, end]`` for messages ready at ``ready`` is

- waiting for the peer (the bubble of the schedule and of unequal stages) up to ``ready``;
- exposed transfer time from ``max(start, ready)`` to ``end``: the message was on its way and the
  compute waited for it to arrive.

So ``exposed = post time + sum over waits of max(0, end - max(start, ready))``. That is the cost
``schedules.replay`` gives a receive (``p2p_time``): paid from the later of the message being
ready and the compute needing it. ``end - ready`` would time the message itself, but a receive
that was ready long before its wait is not timed by it (on a CPU, gloo's thread may only move
the data once the rank waits, so ``end - ready`` would count the compute in between). The replay
takes per stage the mean exposed cost of its activation and of its gradient receives (over all
of them: one that had arrived before the compute needed it costs 0) and the mean post time per
transfer, so with the run's order of actions it reproduces the measured exposed time exactly.

Knowing ``ready`` needs the peer's post times: every rank writes its own posts (int64
microseconds of the wall clock) into its slots of a vector with one slot per transfer action of
the whole schedule (``message_slots``), and one MAX all-reduce over the pipeline group, the one
that also finds the phase's ends for the measured bubble, hands every rank all of them. The
figures are then computed on the device (``rank_exposure``), without a host read, and travel in
the next step's statistics all-reduce (engine/training/late_figures.py). Comparing a peer's post
time with this rank's wait needs one clock: the trainer computes these figures only when the
pipeline's ranks share a host (``LaunchEnv.one_host``) and reports them as null otherwise. ``exposure`` is the same
on the host, for a whole pipeline's gathered spans (benchmarks, tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.pipeline.actions import RECV_B, RECV_F, Action
from parallel.pipeline.replay import match_messages

DIRECTIONS = (RECV_F, RECV_B)   # latency slots per stage: activation receives, gradient receives


@dataclass(frozen=True)
class TransferSpan:
    kind: str                  # "post" (posting a batch) or "wait" (waiting for transfers)
    start: float               # seconds (the rank's timeline: wall seconds once resolved)
    end: float
    actions: tuple[int, ...]   # indices into the rank's program of the transfers it covers


@dataclass
class StageTransfers:
    """What the replay takes per pipeline rank: seconds per posted transfer, and the mean exposed
    cost of its activation and of its gradient receives (0.0 where it has none)."""
    post: list[float]
    latency_f: list[float]
    latency_b: list[float]

    def costs(self, lists):
        """(p2p_time, post_time) functions of (rank, action) for ``schedules.replay``."""
        def p2p(rank: int, a: Action) -> float:
            return (self.latency_f if a.kind == RECV_F else self.latency_b)[rank]
        return p2p, (lambda rank, a: self.post[rank])


def message_slots(lists) -> tuple[dict[tuple[int, int], int], dict]:
    """(slot of every (rank, index) transfer action, in program order rank by rank; the
    partner map of ``replay.match_messages``)."""
    slots, k = {}, 0
    for r, actions in enumerate(lists):
        for i, a in enumerate(actions):
            if a.is_comm:
                slots[(r, i)] = k
                k += 1
    return slots, match_messages(lists)


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


def local_posts(spans, rank: int, slots: dict, size: int) -> list[int]:
    """This rank's slots of the post vector (int64 microseconds of each post's end), 0 elsewhere."""
    out = [0] * size
    for s in spans:
        if s.kind == "post":
            for i in s.actions:
                out[slots[(rank, i)]] = _us(s.end)
    return out


def rank_exposure(lists, rank: int, spans, posts: torch.Tensor, slots=None):
    """This rank's exposed transfer seconds and per-direction mean exposed cost of a receive (over
    every receive of that direction in its program), as 0-d fp32 tensors on ``posts``' device:
    (exposed, [cost of a RECV_F, cost of a RECV_B]).

    ``posts``: the whole pipeline's post vector (int64 microseconds, every slot filled, as the
    MAX all-reduce leaves it); ``spans``: this rank's TransferSpans in the same time base.
    Differences are taken in int64 microseconds (exact), then converted."""
    slots, partner = slots or message_slots(lists)
    device = posts.device
    post_us = sum(_us(s.end) - _us(s.start) for s in spans if s.kind == "post")
    waits = [s for s in spans if s.kind == "wait" and s.actions]
    zero = torch.zeros((), dtype=torch.float32, device=device)
    if not waits:
        return zero + post_us / 1e6, [zero, zero]
    rows, own, other, kinds = [], [], [], []
    for w, s in enumerate(waits):
        for i in s.actions:
            rows.append(w)
            own.append(slots[(rank, i)])
            other.append(slots[partner[(rank, i)]])
        recvs = {lists[rank][i].kind for i in s.actions} & set(DIRECTIONS)
        kinds.append(DIRECTIONS.index(recvs.pop()) if len(recvs) == 1 else -1)
    ix = lambda values: _to(values, device)  # noqa: E731
    both = torch.maximum(posts[ix(own)], posts[ix(other)])
    ready = torch.zeros(len(waits), dtype=torch.int64, device=device).scatter_reduce(
        0, ix(rows), both, "amax", include_self=False)
    start, end = ix([_us(s.start) for s in waits]), ix([_us(s.end) for s in waits])
    exposed = (end - torch.maximum(start, ready)).clamp(min=0)
    kind = ix(kinds)
    latencies = []
    for d, direction in enumerate(DIRECTIONS):
        total = torch.where(kind == d, exposed, torch.zeros_like(exposed)).sum()
        count = max(1, sum(a.kind == direction for a in lists[rank]))
        latencies.append(total.to(torch.float32) / 1e6 / count)
    return (exposed.sum() + post_us).to(torch.float32) / 1e6, latencies


def _to(values: list[int], device) -> torch.Tensor:
    """Host integers as an int64 tensor on ``device`` without a wait (pinned, asynchronous)."""
    t = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type in ("cpu", "meta"):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def post_per_transfer(spans) -> float:
    """Seconds of posting per transfer action of this rank (0.0 without transfers)."""
    posts = [s for s in spans if s.kind == "post"]
    n = sum(len(s.actions) for s in posts)
    return sum(s.end - s.start for s in posts) / n if n else 0.0


@dataclass
class Exposure:
    exposed: list[float]        # per rank: seconds the compute waited on transfers
    stages: StageTransfers      # per rank: what the replay takes


def exposure(lists, spans_by_rank) -> Exposure:
    """``rank_exposure`` for every rank of one pipeline from its gathered spans (on the host)."""
    slots, partner = message_slots(lists)
    posts = [0] * len(slots)
    for r, spans in enumerate(spans_by_rank):
        for k, v in enumerate(local_posts(spans, r, slots, len(slots))):
            posts[k] = max(posts[k], v)
    vector = torch.tensor(posts, dtype=torch.int64)
    exposed, lat_f, lat_b = [], [], []
    for r, spans in enumerate(spans_by_rank):
        e, (f, b) = rank_exposure(lists, r, spans, vector, (slots, partner))
        exposed.append(float(e))
        lat_f.append(float(f))
        lat_b.append(float(b))
    return Exposure(exposed, StageTransfers([post_per_transfer(s) for s in spans_by_rank],
                                            lat_f, lat_b))
