"""Point-to-point transfers of activations and gradients between neighbouring pipeline stages.

Each batch of transfers is posted with one ``torch.distributed.batch_isend_irecv`` (NCCL/HCCL
turn it into one group call, so a send to the next stage and a receive from it cannot block each
other) and then waited for as a whole. The order of transfers inside a batch and of batches on a
rank comes from the schedule, which ``schedules.validate_schedule`` proves matched and
deadlock-free; the backends (gloo included) pair the transfers between two ranks in posting order.

Receivers know the shape and dtype in advance (the caller allocates the buffer), so no shape
handshake is needed. Every wait has a timeout: a neighbour that died or is stuck produces an error
naming its stage and rank instead of a hang. How a rank waits depends on the backend
(``waiter_for``):

- gloo: ``work.wait(timeout)`` blocks the host until the transfer is done (``HostWait``); a
  timeout or a broken connection raises ``PipelineCommError`` at once.
- NCCL and HCCL: ``work.wait()`` without a timeout only makes the compute stream wait for the
  transfer, so the host keeps queueing work (``StreamWait``). With a timeout argument NCCL's
  ``WorkNCCL::wait`` instead polls ``isCompleted()`` on the host until the transfer finishes, a
  host busy-wait on every transfer, and torch_npu's ``WorkHCCL::wait`` ignores the timeout unless
  the whole job runs with ``TORCH_HCCL_BLOCKING_WAIT=1`` (which blocks the host on every collective
  too). So the timeout is kept by a ``TransferWatchdog`` thread that polls each posted batch
  (``is_completed()``, ``exception()``) a few times per timeout and, when a batch has not
  completed ``timeout_s`` after it was posted or its work failed, prints the same message naming
  the neighbour's stage and ends the process, so the launcher ends the job.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel.runtime import streams


class PipelineCommError(RuntimeError):
    """A neighbouring stage did not complete a transfer (timed out, failed or disconnected)."""


@dataclass
class Transfer:
    op: str                  # "send" or "recv"
    tensor: torch.Tensor     # contiguous; for "recv" the buffer to fill
    peer_stage: int          # pipeline rank of the neighbour
    peer_rank: int           # its global rank
    what: str                # "activation" or "gradient"
    microbatch: int
    chunk: int = 0           # model chunk of the neighbour that produces / consumes the tensor

    def __post_init__(self) -> None:
        if self.op not in ("send", "recv"):
            raise ValueError(f"Transfer.op must be 'send' or 'recv', got {self.op!r}")
        if not self.tensor.is_contiguous():
            raise ValueError("Transfer tensors must be contiguous; call .contiguous() first")

    def describe_failure(self, timeout_s: float | None, timed_out: bool, vp: int) -> str:
        chunk = f" (model chunk {self.chunk})" if vp > 1 else ""
        peer = f"pipeline stage {self.peer_stage} (rank {self.peer_rank})"
        if not timed_out:
            verb = "sending" if self.op == "recv" else "receiving"
            return f"{peer} failed or disconnected before {verb} the {self.what} of micro-batch " \
                   f"{self.microbatch}{chunk}"
        if self.op == "recv":
            return f"{peer} sent no {self.what} for micro-batch {self.microbatch}{chunk} " \
                   f"within {timeout_s:g} s"
        return f"{peer} did not receive the {self.what} of micro-batch {self.microbatch}{chunk} " \
               f"within {timeout_s:g} s"


def init_p2p(ps) -> None:
    """Create the pipeline group's communicator with one collective, on every rank of the group.

    NCCL/HCCL create communicators lazily, and a first ``batch_isend_irecv`` that not every rank of
    the group joins is undefined behaviour there; calling this once after ``ParallelState``
    initialisation avoids that. A no-op without pipeline parallelism.
    """
    if ps.pp_size > 1:
        ps.pp_group.all_reduce(torch.zeros(1, device=ps.device))


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def failure_message(ps, culprits: list[Transfer], cause: str, timeout_s: float | None,
                    timed_out: bool, vp: int) -> str:
    """What a rank reports when transfers did not complete: the neighbour and micro-batch first."""
    why = "; ".join(t.describe_failure(timeout_s, timed_out, vp) for t in culprits)
    me = f"pipeline stage {ps.pp_rank} (rank {ps.rank})"
    return f"{why} ({me} was waiting). Check that stage's log. [{cause}]"


def _pending(works: list, transfers: list[Transfer]) -> list[tuple[object, list[Transfer]]]:
    """(work, its transfers), receives first: "stage s sent nothing" is the more useful error.
    gloo returns one work per transfer; NCCL/HCCL may coalesce the batch into a single work."""
    if len(works) == len(transfers):
        return sorted(((w, [t]) for w, t in zip(works, transfers)), key=lambda wt: wt[1][0].op != "recv")
    recvs_first = sorted(transfers, key=lambda t: t.op != "recv")
    return [(work, recvs_first) for work in works]


class HostWait:
    """Block the host on each work with the timeout (gloo, whose waits are host waits anyway)."""
    mode = "host"

    def wait(self, ps, works: list, transfers: list[Transfer], timeout_s: float | None, vp: int,
             posted_at: float | None = None) -> None:
        """``posted_at``: unused (gloo's own timeout runs per wait)."""
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        for work, owners in _pending(works, transfers):
            try:
                work.wait() if timeout is None else work.wait(timeout)
            except RuntimeError as exc:
                cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise PipelineCommError(failure_message(ps, owners, cause, timeout_s,
                                                        _is_timeout(exc), vp)) from exc


def exit_on_timeout(message: str) -> None:
    """The watchdog's default: say which stage failed, then end this process (the launcher, e.g.
    torchrun, then ends the others); the main thread may be blocked in the device runtime."""
    print(f"gridtron: PipelineCommError: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_PIPELINE_TIMEOUT)


EXIT_PIPELINE_TIMEOUT = 75


class TransferWatchdog:
    """A daemon thread that keeps the timeout of transfers nobody waits for on the host.

    ``watch(ps, works, transfers, timeout_s, vp, posted_at)`` registers one posted batch
    (``posted_at``: ``time.monotonic()`` at its post, ``PostedBatch.posted_at``; None: now); every
    ``poll_s`` (a tenth of the shortest timeout, at most 1 s) the thread drops the batches whose
    works completed, and calls ``on_timeout(message)`` once for a batch whose work raised or that is
    still incomplete ``timeout_s`` after it was posted, as NCCL's own timeout counts from the post.
    A batch is watched from its first wait (a send's: the end of the schedule); one first waited for
    after its deadline is reported at the next poll. It keeps the works until they complete,
    and of the transfers only what the message needs (not their tensors, so a sent activation's
    memory is freed when the executor drops it). ``stop()`` ends the thread. The thread binds the
    rank's device first (parallel/runtime/streams.py ``start_thread``); an error of the watchdog
    itself while it polls a batch goes to ``on_timeout`` as one line naming the transfers it watched
    (``watchdog_failure``), so a broken poll ends the job instead of silently losing the timeout.
    """

    def __init__(self, on_timeout: Callable[[str], None] = exit_on_timeout, poll_s: float | None = None):
        self.on_timeout, self.poll_s = on_timeout, poll_s
        self._batches: list = []              # (deadline, works, transfers, ps, timeout_s, vp)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: streams.StreamThread | None = None
        self.fired: list[str] = []
        self._no_data = torch.empty(0)

    def watch(self, ps, works: list, transfers: list[Transfer], timeout_s: float | None, vp: int,
              posted_at: float | None = None) -> None:
        if timeout_s is None or not works:
            return
        described = [dataclasses.replace(t, tensor=self._no_data) for t in transfers]
        since = time.monotonic() if posted_at is None else posted_at
        with self._lock:
            self._batches.append((since + timeout_s, list(works), described, ps, timeout_s, vp))
            if self.poll_s is None or timeout_s / 10 < self.poll_s:
                self.poll_s = min(1.0, timeout_s / 10)
            if self._thread is None:
                # bound to the rank's device (a work's poll may touch the device runtime); an
                # error that escapes the loop still ends the job with one line
                self._thread = streams.start_thread(
                    "gridtron-p2p-watchdog", self._run, ps.device,
                    on_error=lambda exc: exit_on_timeout(f"the pipeline watchdog failed: "
                                                         f"{type(exc).__name__}: {exc}"))
                atexit.register(self.stop)  # a daemon thread in a backend call aborts exit

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._batches)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now, fire = time.monotonic(), []
            with self._lock:
                keep = []
                for batch in self._batches:
                    try:
                        message = self._poll(batch, now)
                    except Exception as exc:  # noqa: BLE001 - the job must not lose the timeout
                        message = watchdog_failure(batch[3], batch[2], exc)
                    if message is None:
                        keep.append(batch)
                    elif message:
                        fire.append(message)
                self._batches = keep
            for message in fire:
                self.fired.append(message)
                self.on_timeout(message)


    @staticmethod
    def _poll(batch, now: float) -> str | None:
        """None: keep watching; "": completed; else the failure's message."""
        deadline, works, transfers, ps, timeout_s, vp = batch
        errors = [w for w in works if _work_error(w) is not None]
        if errors:
            cause = str(_work_error(errors[0])).splitlines()[0]
            return failure_message(ps, _culprits(works, transfers), cause, timeout_s, False, vp)
        if all(w.is_completed() for w in works):
            return ""
        if now < deadline:
            return None
        return failure_message(ps, _culprits(works, transfers), "watchdog", timeout_s, True, vp)


def watchdog_failure(ps, transfers: list[Transfer], exc: BaseException) -> str:
    """One line for an error of the watchdog itself while it polled ``transfers``: the job ends
    (a dead watchdog would lose the transfer's timeout), naming what it was watching."""
    what = "; ".join(f"{t.op} of the {t.what} of micro-batch {t.microbatch} with pipeline stage "
                     f"{t.peer_stage} (rank {t.peer_rank})" for t in transfers)
    first = str(exc).splitlines()[0] if str(exc) else ""
    me = f"pipeline stage {ps.pp_rank} (rank {ps.rank})"
    return f"the transfer watchdog of {me} failed while watching the {what}: " \
           f"{type(exc).__name__}: {first}"


def _work_error(work):
    try:
        return work.exception()
    except RuntimeError:  # works that keep no exception (completed or not started)
        return None


def _culprits(works: list, transfers: list[Transfer]) -> list[Transfer]:
    """The transfers of a batch that did not complete (all of them for a coalesced work)."""
    open_ = [owners for work, owners in _pending(works, transfers) if not work.is_completed()]
    return [t for owners in open_ for t in owners] or sorted(transfers, key=lambda t: t.op != "recv")


class StreamWait:
    """Order the compute stream after each transfer without blocking the host (NCCL, HCCL);
    the timeout is kept by ``watchdog``, counted from ``posted_at`` (the batch's post; None:
    now)."""
    mode = "stream"

    def __init__(self, watchdog: TransferWatchdog | None = None):
        self.watchdog = watchdog or TransferWatchdog()

    def wait(self, ps, works: list, transfers: list[Transfer], timeout_s: float | None, vp: int,
             posted_at: float | None = None) -> None:
        self.watchdog.watch(ps, works, transfers, timeout_s, vp, posted_at)
        for work, owners in _pending(works, transfers):
            try:
                work.wait()        # no timeout argument: a stream wait, not a host poll
            except RuntimeError as exc:   # a failure the backend reports at once
                cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise PipelineCommError(failure_message(ps, owners, cause, timeout_s, False, vp)) from exc


def waiter_for(backend: str):
    """How transfers on ``backend`` are waited for (see the module docstring).

    >>> waiter_for("gloo").mode, waiter_for("nccl").mode, waiter_for("hccl").mode
    ('host', 'stream', 'stream')
    """
    return StreamWait() if backend in ("nccl", "hccl") else HostWait()


@dataclass
class PostedBatch:
    """A batch of transfers posted with one ``batch_isend_irecv``, not yet (all) waited for.
    gloo returns one work per transfer, so a subset (the receives a compute step needs) can be
    waited for alone; NCCL and HCCL may coalesce the batch into one work, waited as a whole."""
    transfers: list[Transfer]
    works: list
    waited: set = field(default_factory=set)  # indices into ``works`` already waited for
    posted_at: float = field(default_factory=time.monotonic)   # where a watchdog's deadline starts

    @property
    def per_transfer(self) -> bool:
        return len(self.works) == len(self.transfers)

    def select(self, indices) -> tuple[list, list[Transfer]]:
        """(works, transfers) covering the transfers at ``indices`` (all of them if coalesced)."""
        if not self.per_transfer:
            return list(self.works), list(self.transfers)
        indices = sorted(set(indices))
        return [self.works[i] for i in indices], [self.transfers[i] for i in indices]

    def unwaited(self, indices) -> tuple[list, list[Transfer]]:
        """``select(indices)`` less the works already waited for (a coalesced batch's one work is
        waited for once, whichever receive or send asks for it first); marks them waited."""
        if not self.per_transfer:
            if self.waited:
                return [], []
            self.waited.update(range(len(self.works)))
            return list(self.works), list(self.transfers)
        todo = sorted(set(indices) - self.waited)
        self.waited.update(todo)
        return [self.works[i] for i in todo], [self.transfers[i] for i in todo]

    def completed(self, indices) -> bool:
        works, _ = self.select(indices)
        return all(w.is_completed() for w in works)

    def drop(self, index: int) -> None:
        """Let go of a receive once waited for (its consumer holds the tensor now): a batch with
        sends is kept until they complete, and its receive's work and buffer would keep the
        received tensor alive with it (gloo reports a send complete only once waited for, at the
        end of the schedule). A coalesced batch's one work covers every transfer: kept whole."""
        if self.per_transfer and index in self.waited and self.transfers[index].op == "recv":
            self.works[index] = None
            self.transfers[index] = dataclasses.replace(self.transfers[index],
                                                        tensor=torch.empty(0))


def post(ps, transfers: list[Transfer], timeout_s: float | None = None, vp: int = 1) -> PostedBatch:
    """Post ``transfers`` as one batch without waiting (``wait_posted`` waits)."""
    try:
        works = ps.pp_group.batch_isend_irecv([(t.op, t.tensor, t.peer_rank) for t in transfers])
    except RuntimeError as exc:
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PipelineCommError(failure_message(ps, transfers, cause, timeout_s, _is_timeout(exc),
                                                vp)) from exc
    return PostedBatch(list(transfers), list(works))


def wait_posted(ps, batch: PostedBatch, indices=None, timeout_s: float | None = None, vp: int = 1,
                waiter=None) -> None:
    """Wait for the transfers at ``indices`` of a posted batch (None: all of them)."""
    works, transfers = batch.unwaited(range(len(batch.transfers)) if indices is None else indices)
    if not works:
        return
    # posted_at: a stream wait's watchdog counts its deadline from the post
    (waiter or HostWait()).wait(ps, works, transfers, timeout_s, vp, posted_at=batch.posted_at)


def communicate(ps, transfers: list[Transfer], timeout_s: float | None = None,
                vp: int = 1, waiter=None) -> float:
    """Post ``transfers`` as one batch and wait for all of them; returns the host seconds spent.

    ``timeout_s=None`` waits without a limit (the process group's own timeout still applies).
    ``waiter`` is ``HostWait()`` (the default) or the ``StreamWait`` of ``waiter_for(backend)``,
    created once per run. On failure raises ``PipelineCommError`` (or, in stream mode, the
    watchdog reports it) naming the neighbour and the micro-batch, and saying which stage and rank
    was waiting.
    """
    if not transfers:
        return 0.0
    start = time.perf_counter()
    wait_posted(ps, post(ps, transfers, timeout_s, vp), None, timeout_s, vp, waiter)
    return time.perf_counter() - start
