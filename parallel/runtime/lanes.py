"""One communicator, one thread: which threads may issue collectives on which process group.

NCCL and HCCL match collectives by their order on a communicator: the n-th collective a rank
enqueues on it meets the n-th of every other member. Two threads that issue on the same
communicator at the same time (the reducer's exchange worker sending DP buckets while autograd
issues the TP and CP collectives of backward) interleave in a different order on different ranks,
and the ranks deadlock, or sum buffers that do not belong together. gloo happens to survive many
such races, so the CPU suite would never show it. The rule: a thread that issues collectives
concurrently with the training loop has communicators of its own, created at start-up with the
others (``new_group`` is collective: it cannot be made later from one thread).

The owner of a group is a *lane*, not an operating-system thread. Every thread that has not
declared a lane is in the main lane: the thread that drives the step and also autograd's device
threads, which on an accelerator run backward (its TP and CP collectives, the reducer's gradient
hooks) while the driving thread waits inside ``backward()``, so they never issue concurrently with
it. A worker thread declares its lane once, when it starts (``enter_lane``, e.g. as a thread pool's
initializer), and every ``CommGroup`` carries the lane it was created for (``CommGroup.lane``). With
backend rules on (``--backend-rules``, and always in the test suite) ``check_lane`` refuses a
collective issued from a thread whose lane is not its group's, naming the group, the thread that
first issued on it and the offending thread, before anything is sent.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from parallel.runtime.backend_rules import BackendRuleError

MAIN_LANE = "main"
EXCHANGE_LANE = "dp-exchange"   # the reducer's exchange worker (parallel/dp/exchange.py)

_local = threading.local()


def current_lane() -> str:
    """The lane of the calling thread (``MAIN_LANE`` unless it declared one)."""
    return getattr(_local, "lane", MAIN_LANE)


def enter_lane(name: str) -> None:
    """Declare the calling thread's lane for the rest of its life (a worker's initializer)."""
    _local.lane = name


@contextmanager
def lane(name: str):
    """Run the block in lane ``name`` on the calling thread, then restore its previous lane."""
    previous = getattr(_local, "lane", None)
    _local.lane = name
    try:
        yield
    finally:
        if previous is None:
            del _local.lane
        else:
            _local.lane = previous


def check_lane(rules, group, op: str) -> None:
    """Raise BackendRuleError if ``rules`` are on and the calling thread's lane is not ``group``'s.

    The first thread to issue on the group is remembered for the message (``group.first_thread``):
    when the error fires it says who was there first."""
    if rules is None:
        return
    mine = getattr(_local, "lane", MAIN_LANE)
    if mine == group.lane:  # the common case, per collective: nothing else to look up
        if group.first_thread is None:
            group.first_thread = threading.current_thread().name
        return
    thread = threading.current_thread().name
    first = f", first used by thread {group.first_thread!r}" if group.first_thread else ""
    fix = ("issue it on the worker's own group (ps.dp_exchange_group for the exchange worker)"
           if group.lane == MAIN_LANE else "issue it from that lane's thread")
    raise BackendRuleError(
        f"{op} over {group!r} from thread {thread!r} (lane {mine!r}), but the group belongs to "
        f"lane {group.lane!r}{first}: {rules.name} deadlocks when two threads enqueue collectives "
        f"on one communicator, since the ranks see them in different orders; {fix}")


def order_mismatch(sequences: dict[int, list[tuple]]) -> str | None:
    """Where two ranks submitted to the communicators they share in different orders (None: they
    never did). ``sequences[rank]``: that rank's collectives in submission order, each
    ``(communicator, op)`` with ``communicator = (kind, lane, ranks)``; point-to-point transfers
    left out (a send meets a receive). NCCL's rule for communicators used concurrently: every rank
    submits to them in the same order; for each pair of ranks the sequences restricted to the
    communicators both belong to must then be equal.

    Example: rank 0 submits (tp all_reduce, dp all_to_all) and rank 1, a member of both groups,
    (dp all_to_all, tp all_reduce): their restricted sequences differ at position 0."""
    ranks = sorted(sequences)
    used = {r: {c for c, _ in sequences[r]} for r in ranks}
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            # every communicator both belong to, used by either: one that only a submitted to
            # stalls it on a serial communicator stream as surely as a different order does
            shared = {c for c in used[a] | used[b] if a in c[2] and b in c[2]}
            if not shared:
                continue
            sa = [x for x in sequences[a] if x[0] in shared]
            sb = [x for x in sequences[b] if x[0] in shared]
            if sa == sb:
                continue
            n = next((k for k, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
            def name(x):
                return "nothing" if x is None else \
                    f"{x[1]} on {x[0][0]}{'' if x[0][1] == MAIN_LANE else '/' + x[0][1]} {list(x[0][2])}"
            return (f"ranks {a} and {b} submit to their shared communicators in different orders: "
                    f"submission {n + 1} is {name(sa[n] if n < len(sa) else None)} on rank {a} "
                    f"but {name(sb[n] if n < len(sb) else None)} on rank {b}")
    return None
