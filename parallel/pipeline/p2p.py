"""Point-to-point transfers of activations and gradients between neighbouring pipeline stages.

Each batch of transfers is posted with one ``torch.distributed.batch_isend_irecv`` (NCCL/HCCL
turn it into one group call, so a send to the next stage and a receive from it cannot block each
other) and then waited for as a whole. The order of transfers inside a batch and of batches on a
rank comes from the schedule, which ``schedules.validate_schedule`` proves matched and
deadlock-free; the backends (gloo included) pair the transfers between two ranks in posting order.

Receivers know the shape and dtype in advance (the caller allocates the buffer), so no shape
handshake is needed. Every wait has a timeout: a neighbour that died or is stuck produces an error
naming its stage and rank instead of a hang.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch


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


def neighbour_ranks(ps) -> tuple[int, int]:
    """Global ranks of the previous and next pipeline stage (wrapping around, as interleaving
    sends chunk c's output of the last stage to chunk c+1 of the first)."""
    pp, me = ps.pp_size, ps.pp_rank
    return ps.stage_rank((me - 1) % pp), ps.stage_rank((me + 1) % pp)


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


def communicate(ps, transfers: list[Transfer], timeout_s: float | None = None,
                vp: int = 1) -> float:
    """Post ``transfers`` as one batch and wait for all of them; returns the seconds spent.

    ``timeout_s=None`` waits without a limit (the process group's own timeout still applies). On
    failure raises ``PipelineCommError`` naming the neighbour and the micro-batch, and saying which
    stage and rank was waiting.
    """
    if not transfers:
        return 0.0
    start = time.perf_counter()
    me = f"pipeline stage {ps.pp_rank} (rank {ps.rank})"

    def failure(culprits, exc, timed_out):
        why = "; ".join(t.describe_failure(timeout_s, timed_out, vp) for t in culprits)
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return PipelineCommError(f"{why} ({me} was waiting). Check that stage's log. [{cause}]")

    try:
        works = ps.pp_group.batch_isend_irecv([(t.op, t.tensor, t.peer_rank) for t in transfers])
    except RuntimeError as exc:
        raise failure(transfers, exc, _is_timeout(exc)) from exc
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    # gloo returns one work per transfer; NCCL/HCCL may coalesce the batch into a single work.
    # Receives are waited for first: "stage s sent nothing" is the more useful error.
    if len(works) == len(transfers):
        pending = sorted(zip(works, transfers), key=lambda wt: wt[1].op != "recv")
    else:
        pending = [(work, None) for work in works]
    for work, owner in pending:
        try:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        except RuntimeError as exc:
            raise failure([owner] if owner is not None else transfers, exc,
                          _is_timeout(exc)) from exc
    return time.perf_counter() - start
