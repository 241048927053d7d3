"""How pipeline transfers are waited for: a host wait with a timeout on gloo, a stream wait on NCCL
and HCCL whose timeout a watchdog thread keeps. On two gloo ranks: a neighbour that sends nothing
makes the watchdog report, naming that neighbour's stage, the micro-batch and the waiting stage;
transfers that complete are forgotten and report nothing; a peer's failure reported at once by the
backend becomes the same PipelineCommError in stream mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from parallel.pipeline.p2p import (EXIT_PIPELINE_TIMEOUT, HostWait, PipelineCommError, StreamWait,
                                   Transfer, TransferWatchdog, communicate, post, wait_posted,
                                   waiter_for)
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.stream_check import stream_checked

ROOT = str(Path(__file__).resolve().parents[3])


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
    # under the stream-order checker: the received buffer is read only after its wait
    results = run_distributed(stream_checked, grid=RankGrid(pp=2), args=(_watchdog_checks,))
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
    run_distributed(_dead_peer, grid=RankGrid(pp=2), args=(str(tmp_path),), timeout_s=60,
                    vanishes=True)
    message = json.loads((tmp_path / "0.json").read_text())["message"]
    assert message.startswith("pipeline stage 1 (rank 1) failed or disconnected before sending the "
                              "activation of micro-batch 2 (pipeline stage 0 (rank 0) was waiting)"), message


class _BrokenWork:
    """A work whose poll raises, as a device runtime error inside is_completed() would."""

    def exception(self):
        return None

    def is_completed(self):
        raise RuntimeError("device lost\nmore detail")


_PS = SimpleNamespace(pp_rank=0, rank=0, device=torch.device("cpu"))
_BROKEN = "the transfer watchdog of pipeline stage 0 (rank 0) failed while watching the recv " \
          "of the activation of micro-batch 3 with pipeline stage 1 (rank 1): RuntimeError: " \
          "device lost"


def test_an_error_inside_the_watchdog_is_reported_naming_the_transfer():
    messages, fired = [], threading.Event()
    dog = TransferWatchdog(on_timeout=lambda m: (messages.append(m), fired.set()), poll_s=0.01)
    dog.watch(_PS, [_BrokenWork()], [Transfer("recv", torch.empty(2), 1, 1, "activation", 3)],
              30.0, 1)
    assert fired.wait(10)
    dog.stop()
    assert messages == [_BROKEN] and dog.pending == 0


class _Pending:
    """A work that never completes (a neighbour that never takes its send)."""

    def exception(self):
        return None

    def is_completed(self):
        return False

    def wait(self):
        return True                 # a stream wait: returns at once


def test_the_watchdog_deadline_counts_from_the_post():
    """A send waited for only at the end of the schedule times out ``timeout_s`` after its post,
    not after that wait: past its deadline by then, it is reported at the next poll."""
    ps = SimpleNamespace(pp_rank=0, rank=0, device=torch.device("cpu"),
                         pp_group=SimpleNamespace(batch_isend_irecv=lambda ops: [_Pending()]))
    fired = threading.Event()
    dog = TransferWatchdog(on_timeout=lambda m: fired.set(), poll_s=0.05)
    batch = post(ps, [Transfer("send", torch.ones(2), 1, 1, "activation", 4)], 2.0)
    time.sleep(2.1)                                             # the rest of the schedule
    wait_posted(ps, batch, None, 2.0, 1, StreamWait(dog))
    try:
        assert fired.wait(1.0), "the deadline started at the wait, not at the post"
    finally:
        dog.stop()
    assert dog.fired == ["pipeline stage 1 (rank 1) did not receive the activation of micro-batch 4 "
                         "within 2 s (pipeline stage 0 (rank 0) was waiting). Check that stage's "
                         "log. [watchdog]"]


def test_a_failing_watchdog_ends_the_process_with_one_line():
    """The default: one line on stderr and the pipeline exit code, not a silently dead thread."""
    code = (
        "import time, torch\n"
        "from tests.parallel.pipeline.test_p2p_wait import _BrokenWork, _PS\n"
        "from parallel.pipeline.p2p import Transfer, TransferWatchdog\n"
        "dog = TransferWatchdog(poll_s=0.01)\n"
        "dog.watch(_PS, [_BrokenWork()], [Transfer('recv', torch.empty(2), 1, 1, 'activation', 3)],"
        " 30.0, 1)\n"
        "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == EXIT_PIPELINE_TIMEOUT, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"gridtron: PipelineCommError: {_BROKEN}"]


def test_threads_bind_the_device_first(monkeypatch):
    """start_thread makes the rank's device current on the new thread before its target runs."""
    from parallel.runtime import streams
    bound = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: bound.append(i))
    seen = []
    thread = streams.start_thread("probe", lambda: seen.append(list(bound)), torch.device("meta"))
    thread.join()
    assert seen == [[]]                     # no accelerator: nothing to bind
    monkeypatch.setattr(streams, "_accelerator", lambda device: True)  # a stand-in device runtime
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: None)
    thread = streams.start_thread("probe", lambda: seen.append(list(bound)),
                                  torch.device("cuda", 3))
    thread.join()
    assert seen[-1] == [3]
