"""The background save's publication: rank 0's ``publish`` failing (a full disk, a missing
permission) at the boundary that publishes, or in ``wait``, is the same one-line CheckpointError on
every rank, as in a synchronous save, instead of a traceback on rank 0 while the others train on
(or wait at a barrier) until the communication timeout."""
from __future__ import annotations

import os
from types import SimpleNamespace

import engine.checkpoint.writer as writer
from engine.checkpoint.async_writer import Checkpointer
from engine.checkpoint.index import CheckpointError
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed


class _Done:
    """A writer thread that has finished: this rank's part is written and verified."""

    def join(self):
        pass

    def finished(self):
        return True


def _in_flight(ps, root: str, step: int):
    """A Checkpointer whose save of ``step`` is written on this rank, ready to publish."""
    trainer = SimpleNamespace(ps=ps, cfg=SimpleNamespace(
        checkpoint=SimpleNamespace(save=root, async_save=True)))
    ck = Checkpointer(trainer)
    snap = SimpleNamespace(step=step, tmp=os.path.join(root, f"iter_{step:07d}.tmp"),
                           final=os.path.join(root, f"iter_{step:07d}"))
    ck.flight = SimpleNamespace(snap=snap, error=None, thread=_Done(), counts=lambda: [1, 0])
    return ck


def _publications(ps, root):
    published, real = [], writer.publish

    def publish(snap):
        published.append(snap.step)
        if snap.step != 2:
            raise OSError(28, "No space left on device")

    out = {}
    writer.publish = publish
    try:
        ck = _in_flight(ps, root, 2)   # published at a boundary: fine
        out["ok"] = ck.boundary(3, due=False, agreed=[0, 0, ps.world_size, 0]).published
        out["flight"] = ck.flight
        for how in ("boundary", "wait"):
            ck = _in_flight(ps, root, 4)
            try:
                if how == "boundary":
                    ck.boundary(5, due=False, agreed=[0, 0, ps.world_size, 0])
                else:
                    ck.wait()
                out[how] = "returned"
            except CheckpointError as exc:
                out[how] = str(exc)
            out[f"{how} flight"] = ck.flight
    finally:
        writer.publish = real
    out["published"] = published
    return out


def test_a_failed_publication_fails_every_rank_with_one_line(tmp_path):
    res = run_distributed(_publications, grid=RankGrid(dp=2), args=(str(tmp_path),), timeout_s=30)
    final = os.path.join(str(tmp_path), "iter_0000004")
    want = (f"rank 0: publishing {final} failed: OSError: [Errno 28] No space left on device; "
            f"latest names the newest checkpoint published")
    for rank, out in enumerate(res):
        assert out["ok"] == os.path.join(str(tmp_path), "iter_0000002") and out["flight"] is None
        assert out["boundary"] == want and out["wait"] == want, out
        assert out["boundary flight"] is None and out["wait flight"] is None
        assert out["published"] == ([2, 4, 4] if rank == 0 else []), out
