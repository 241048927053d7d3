"""The vocabulary of pipeline schedules: action kinds, actions, and a schedule's per-rank programs.

An ``Action`` is one step of one rank's program: a compute step (``F`` forward, ``B`` backward,
``W`` weight gradient) or a transfer to or from a neighbouring virtual stage. A ``Schedule`` is the
list of programs, one per pipeline rank, together with the placement of model chunks on ranks
(``partition.virtual_stage``): which virtual stage a (rank, chunk) runs decides who its neighbours
are and which stage boundaries stay on one rank (no transfer at all).

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split a backward
into ``B``, the gradient of the chunk's input (what the previous stage waits for), and ``W``, the
gradients of its weights, which nothing downstream waits for and which a schedule may defer into
what would otherwise be idle time. In schedules without ``W`` actions ``B`` computes both.

``RankProgram`` writes one rank's program from its order of compute steps: each ``F`` and ``B`` is
wrapped in exactly the transfers its virtual stage needs (``RECV_F F SEND_F``, ``RECV_B B
SEND_B``), a ``W`` has none, and every run of consecutive transfers is sorted into the canonical
order (activations first, gradients second, sends before receives). With pp=2 both neighbours are
the same peer, and the backends pair the messages between two ranks in posting order.

A run of transfers is posted as one batch, or several (``batches``): HCCL's ``HcclBatchSendRecv``
takes at most one send to and one receive from each peer per call ("the task list must not contain
duplicate sending or receiving tasks pointed to the same rank", CANN's API reference; it reorders
the tasks of a call, so two of one direction would be confused), and with pp=2 the interleaved
schedule's runs hold an activation and a gradient for the same peer. Each batch ends before a
transfer whose direction and peer it already holds, on every backend alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from parallel.pipeline.partition import stage_owner, virtual_stage


class Kind(str, Enum):
    RECV_F = "recv_f"   # receive this chunk's input activation from the previous virtual stage
    F = "f"             # forward of one micro-batch through one chunk
    SEND_F = "send_f"   # send the output activation to the next virtual stage
    RECV_B = "recv_b"   # receive the gradient of the output from the next virtual stage
    B = "b"             # backward of one micro-batch through one chunk (input gradient; with no
                        # W action for it in the schedule, the weight gradients too)
    SEND_B = "send_b"   # send the gradient of the input to the previous virtual stage
    W = "w"             # the weight gradients of one micro-batch through one chunk


RECV_F, F, SEND_F, RECV_B, B, SEND_B, W = (Kind.RECV_F, Kind.F, Kind.SEND_F, Kind.RECV_B, Kind.B,
                                           Kind.SEND_B, Kind.W)
COMM_KINDS = frozenset({RECV_F, SEND_F, RECV_B, SEND_B})
BATCH_ORDER = {SEND_F: 0, RECV_F: 1, SEND_B: 2, RECV_B: 3}


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int = 0

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __repr__(self) -> str:
        return f"{self.kind.name}({self.microbatch},{self.chunk})"


class Schedule(list):
    """``schedule[pp_rank]`` is that rank's list of actions; ``name`` is the schedule it was built
    as and ``placement`` the chunk placement its transfers assume ("loop" or "v"). A plain list of
    lists is a schedule with the "loop" placement."""

    def __init__(self, lists, name: str = "custom", placement: str = "loop"):
        super().__init__(list(actions) for actions in lists)
        self.name, self.placement = name, placement

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, pp={len(self)}, placement={self.placement!r})"


def placement_of(lists) -> str:
    """The placement a schedule's transfers assume ("loop" for plain lists)."""
    return getattr(lists, "placement", "loop")


def has_weight_actions(actions) -> bool:
    """Whether a program (one rank's list, or a whole schedule) splits backwards into B and W."""
    if actions and not isinstance(actions[0], Action):
        return any(has_weight_actions(a) for a in actions)
    return any(a.kind == W for a in actions)


def neighbour(rank: int, chunk: int, pp: int, vp: int, placement: str,
              step: int) -> tuple[int, int] | None:
    """(rank, chunk) of the virtual stage ``step`` (+1 or -1) away from (rank, chunk); None past
    either end of the pipeline."""
    stage = virtual_stage(rank, chunk, pp, placement) + step
    if not 0 <= stage < pp * vp:
        return None
    return stage_owner(stage, pp, placement)


def message(action: Action, rank: int, pp: int, vp: int, placement: str) -> tuple[int, tuple]:
    """(peer pp rank, message id) of a transfer; the id names the stage boundary it crosses.
    Raises ValueError for a transfer across no boundary, or across one inside this rank."""
    stage = virtual_stage(rank, action.chunk, pp, placement)
    step = +1 if action.kind in (SEND_F, RECV_B) else -1
    other = neighbour(rank, action.chunk, pp, vp, placement, step)
    if other is None:
        raise ValueError(f"rank {rank}: {action!r} crosses no stage boundary (virtual stage "
                         f"{stage} of {pp * vp})")
    if other[0] == rank:
        raise ValueError(f"rank {rank}: {action!r} crosses the boundary to virtual stage "
                         f"{stage + step}, which runs on the same rank: no transfer belongs there")
    boundary = stage if step > 0 else stage - 1             # between boundary and boundary + 1
    stream = "activation" if action.kind in (SEND_F, RECV_F) else "gradient"
    return other[0], (stream, action.microbatch, boundary)


def batches(actions, rank: int, pp: int, vp: int, placement: str) -> list[tuple[int, int]]:
    """[start, stop) of every batch of one rank's program: each run of consecutive transfers, cut
    before a transfer whose (direction, peer) the batch already holds (module docstring). Pure.

    >>> run = [Action(SEND_F, 2, 0), Action(SEND_B, 0, 1), Action(RECV_B, 1, 1)]   # rank 0, pp=2
    >>> batches([Action(F, 2, 0)] + run, 0, 2, 2, "loop")
    [(1, 2), (2, 4)]
    """
    out, i = [], 0
    while i < len(actions):
        if not actions[i].is_comm:
            i += 1
            continue
        start, held = i, set()
        while i < len(actions) and actions[i].is_comm:
            peer = message(actions[i], rank, pp, vp, placement)[0]
            key = (actions[i].kind in (SEND_F, SEND_B), peer)
            if key in held:
                out.append((start, i))
                start, held = i, set()
            held.add(key)
            i += 1
        out.append((start, i))
    return out


class RankProgram:
    """One rank's program, written compute step by compute step (see the module docstring)."""

    def __init__(self, pp: int, rank: int, vp: int = 1, placement: str = "loop"):
        self.pp, self.rank, self.vp, self.placement = pp, rank, vp, placement
        self.actions: list[Action] = []

    def _remote(self, chunk: int, step: int) -> bool:
        """Whether the stage ``step`` away exists and runs on another rank (needs a transfer)."""
        other = neighbour(self.rank, chunk, self.pp, self.vp, self.placement, step)
        return other is not None and other[0] != self.rank

    def forward(self, micro: int, chunk: int = 0) -> None:
        self.actions += ([Action(RECV_F, micro, chunk)] if self._remote(chunk, -1) else []) \
            + [Action(F, micro, chunk)] \
            + ([Action(SEND_F, micro, chunk)] if self._remote(chunk, +1) else [])

    def backward(self, micro: int, chunk: int = 0) -> None:
        self.actions += ([Action(RECV_B, micro, chunk)] if self._remote(chunk, +1) else []) \
            + [Action(B, micro, chunk)] \
            + ([Action(SEND_B, micro, chunk)] if self._remote(chunk, -1) else [])

    def weight(self, micro: int, chunk: int = 0) -> None:
        self.actions.append(Action(W, micro, chunk))

    def compute(self, kind: Kind, micro: int, chunk: int = 0) -> None:
        {F: self.forward, B: self.backward, W: self.weight}[kind](micro, chunk)

    def done(self) -> list[Action]:
        """The actions with each run of transfers sorted into the canonical batch order."""
        out, run = [], []
        for action in self.actions + [None]:
            if action is not None and action.is_comm:
                run.append(action)
                continue
            out.extend(sorted(run, key=lambda a: BATCH_ORDER[a.kind]))
            run = []
            if action is not None:
                out.append(action)
        return out
