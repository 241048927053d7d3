"""How pipeline transfers are waited for: a host wait with a timeout on gloo, a stream wait on NCCL
and HCCL whose timeout a watchdog thread keeps. On two gloo ranks: a neighbour that sends nothing
makes the watchdog report, naming that neighbour's stage, the micro-batch and the waiting stage;
transfers that complete are forgotten and report nothing; a peer's failure reported at once by the
backend becomes the same PipelineCommError in stream mode."""
from __future__ import annotations

import json
import os
import threading
import time

import torch

from parallel.pipeline.p2p import (HostWait, PipelineCommError, StreamWait, Transfer,
                                   TransferWatchdog, communicate, waiter_for)
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed


def test_waiter_per_backend():
    assert isinstance(waiter_for("gloo"), HostWait)
    assert isinstance(waiter_for("nccl"), StreamWait) and isinstance(waiter_for("hccl"), StreamWait)


def _watchdog_checks(ps):
    out = {}
    peer = ps.stage_rank(1 - ps.pp_rank)
    fired = threading.Event()
    dog = TransferWatchdog(on_timeout=lambda message: fired.set())
    # 1. stage 1 holds back its activation for 4 s; stage 0's watchdog (0.5 s) reports it
    if ps.pp_rank == 0:
        buf = torch.empty(3)
        transfer = Transfer("recv", buf, 1, peer, "activation", 0)
        works = ps.pp_group.batch_isend_irecv([("recv", buf, peer)])
        dog.watch(ps, works, [transfer], 0.5, 1)
        out["fired_in_time"] = fired.wait(30)
        for w in works:
            w.wait()                        # the late send arrives: the transfer itself is intact
        out["received"] = buf.tolist()
        out["messages"] = list(dog.fired)
    else:
        time.sleep(4.0)
        for w in ps.pp_group.batch_isend_irecv([("send", torch.arange(3.0), peer)]):
            w.wait()
    # 2. transfers that complete in time are dropped and never reported
    quiet = TransferWatchdog(on_timeout=lambda message: fired.set(), poll_s=0.05)
    fired.clear()
    t = torch.full((2,), float(ps.rank)) if ps.pp_rank == 0 else torch.empty(2)
    op = "send" if ps.pp_rank == 0 else "recv"
    transfer = Transfer(op, t, 1 - ps.pp_rank, peer, "gradient", 1)
    communicate(ps, [transfer], 5.0, 1, StreamWait(quiet))   # gloo's wait blocks until done
    time.sleep(0.5)
    out["quiet"] = (quiet.pending, fired.is_set(), t.tolist())
    dog.stop(), quiet.stop()
    return out


def test_watchdog_names_the_stage_that_sent_nothing():
    results = run_distributed(_watchdog_checks, grid=RankGrid(pp=2))
    first = results[0]
    assert first["fired_in_time"] and first["received"] == [0.0, 1.0, 2.0]
    assert first["messages"] == [
        "pipeline stage 1 (rank 1) sent no activation for micro-batch 0 within 0.5 s (pipeline "
        "stage 0 (rank 0) was waiting). Check that stage's log. [watchdog]"]
    for r in results:
        assert r["quiet"][:2] == (0, False) and r["quiet"][2] == [0.0, 0.0]


def _dead_peer(ps, out_dir):
    """Stage 1 exits before sending; in stream mode stage 0 still names it."""
    peer = ps.stage_rank(1 - ps.pp_rank)
    if ps.pp_rank == 1:
        time.sleep(0.5)
        os._exit(0)                                # the process vanishes, no error report
    dog = TransferWatchdog(on_timeout=lambda message: None)
    try:
        communicate(ps, [Transfer("recv", torch.empty(4), 1, peer, "activation", 2)], 30.0, 1,
                    StreamWait(dog))
        message = "no error"
    except PipelineCommError as exc:
        message = str(exc)
    dog.stop()
    with open(os.path.join(out_dir, "0.json"), "w", encoding="utf-8") as f:
        json.dump({"message": message}, f)
    os._exit(0)  # the peer is gone: skip the final barrier, which could only fail


def test_stream_wait_reports_a_dead_neighbour_by_stage(tmp_path):
    run_distributed(_dead_peer, grid=RankGrid(pp=2), args=(str(tmp_path),), timeout_s=60)
    message = json.loads((tmp_path / "0.json").read_text())["message"]
    assert message.startswith("pipeline stage 1 (rank 1) failed or disconnected before sending the "
                              "activation of micro-batch 2 (pipeline stage 0 (rank 0) was waiting)"), message
