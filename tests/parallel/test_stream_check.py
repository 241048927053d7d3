"""The stream-order checker catches each kind of violation planted on a fake second stream, names
both streams and the tensor's origin, and accepts the orderings that fix them (an event wait, a
stream wait, a thread join, record_stream before a release)."""
from __future__ import annotations

import ast

import pytest
import torch

from parallel.runtime import streams
from parallel.runtime.stream_check import StreamChecker, StreamOrderError
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed


@pytest.fixture
def checker():
    checker = StreamChecker()
    with checker.installed():
        yield checker


def _one(checker: StreamChecker, kind: str) -> str:
    assert len(checker.violations) == 1, checker.violations
    message = checker.violations[0]
    assert message.startswith(kind), message
    return message


def test_read_after_unordered_write(checker):
    side = streams.side_stream("side", "cpu")
    with streams.use(side):
        x = torch.ones(4)                       # written on the side stream
    x.sum()                                     # read on compute, nothing between
    message = _one(checker, "read after an unordered write")
    assert "'compute'" in message and "'side'" in message
    assert "tests/parallel/test_stream_check.py" in message and "ones" in message
    with pytest.raises(StreamOrderError, match="1 stream-order violation"):
        checker.check()


def test_a_wait_orders_it(checker):
    side = streams.side_stream("side", "cpu")
    with streams.use(side):
        x = torch.ones(4)
    streams.wait_stream(streams.current_stream("cpu"), side)
    x.sum()
    event = streams.record_event(streams.current_stream("cpu"))  # back: compute -> side, an event
    x.add_(1)
    streams.wait_event(event, side)
    with streams.use(side):
        x.mul_(2)                               # after the event, but not after add_: a race
    assert len(checker.violations) == 1 and "add_" in checker.violations[0]
    checker.violations.clear()
    streams.wait_stream(side, streams.current_stream("cpu"))
    with streams.use(side):
        x.mul_(2)
    checker.check()


def test_write_after_unordered_read(checker):
    side = streams.side_stream("side", "cpu")
    x = torch.ones(4)
    streams.wait_stream(side, streams.current_stream("cpu"))
    with streams.use(side):
        x * 2                                   # the side stream reads x
    x.fill_(0)                                  # compute overwrites it before the read is done
    message = _one(checker, "write after an unordered read")
    assert "fill_ on stream 'compute'" in message and "mul on stream 'side'" in message


def test_release_while_another_stream_reads(checker):
    side = streams.side_stream("side", "cpu")
    x, y = torch.ones(4), torch.ones(4)
    streams.wait_stream(side, streams.current_stream("cpu"))
    with streams.use(side):
        x * 2
        y * 2
    streams.released(x)                         # its block may go to the next allocation now
    _one(checker, "released while in use")
    streams.record_stream(y, side)              # the fix: the allocator waits for the side stream
    streams.released(y)
    assert len(checker.violations) == 1


def test_reuse_of_a_freed_address_while_another_stream_reads(checker):
    """A storage dropped by Python whose address a new storage of the same stream gets (as the
    caching allocator hands a freed block to the next allocation of its stream); frombuffer makes
    the reuse deterministic."""
    side = streams.side_stream("side", "cpu")
    memory = bytearray(4096)
    x = torch.frombuffer(memory, dtype=torch.float32)
    x.fill_(1)                                  # first seen on compute: its block is compute's
    streams.wait_stream(side, streams.current_stream("cpu"))
    with streams.use(side):
        x.sum()
    del x
    y = torch.frombuffer(memory, dtype=torch.float32)
    y.zero_()
    message = _one(checker, "reused while in use")
    assert "zero_ (a new storage) on stream 'compute' takes its block" in message
    assert "sum on stream 'side'" in message


def test_backward_runs_under_the_checker(checker):
    """autograd's CPU backward runs on the calling thread, under its dispatch mode."""
    side = streams.side_stream("side", "cpu")
    x = torch.ones(3, requires_grad=True)
    w = torch.full((3,), 2.0)
    loss = (x * w).sum()
    streams.wait_stream(side, streams.current_stream("cpu"))
    with streams.use(side):
        w.data.add_(1)                          # ordered after the forward's read
    checker.check()
    loss.backward()                             # mul's backward reads w: not ordered after add_
    message = _one(checker, "read after an unordered write")
    assert "add_ on stream 'side'" in message


def test_thread_join_orders_its_work(checker):
    box = {}
    thread = streams.start_thread("writer", lambda: box.setdefault("t", torch.ones(4)), "cpu")
    thread.thread.join()                        # a host join the checker does not see
    box["t"].sum()
    message = _one(checker, "read after an unordered write")
    assert "'writer'" in message
    checker.violations.clear()
    thread = streams.start_thread("writer2", lambda: box.__setitem__("u", torch.ones(4)), "cpu")
    thread.join()
    box["u"].sum()
    v = torch.ones(4)
    thread = streams.start_thread("writer3", lambda: v.mul_(2), "cpu")  # ordered after v's creation
    thread.join()
    v.sum()
    checker.check()


def test_a_thread_reads_host_copies_after_synchronizing_on_their_event(checker):
    """The background save's pattern: a thread started before the copies exist reads them only
    after the host waited for the event recorded behind them (``streams.synchronize``)."""
    import threading
    go, box = threading.Event(), {}

    def reader(wait: bool):
        go.wait(timeout=30)
        if wait:
            streams.synchronize(box["event"])
        box["host"].sum()

    for wait in (False, True):
        go.clear()
        thread = streams.start_thread(f"reader-{wait}", lambda w=wait: reader(w), "cpu")
        box["host"] = torch.ones(4) * 2           # the copies, queued on the compute stream
        box["event"] = streams.record_event(streams.current_stream("cpu"))
        go.set()
        thread.join()
        if not wait:
            message = _one(checker, "read after an unordered write")
            assert "sum on stream 'reader-False'" in message and "stream 'compute'" in message, message
            checker.violations.clear()
    checker.check()


def test_thread_errors_reach_on_error():
    errors = []

    def boom():
        raise ValueError("bad")

    thread = streams.start_thread("boom", boom, "cpu", on_error=errors.append)
    thread.join()
    assert [str(e) for e in errors] == ["bad"] and isinstance(thread.error, ValueError)


def _collective_checks(ps):
    """Each rank plants, under its own checker, an async all-reduce read before wait() and a
    send buffer overwritten before wait(), then runs the ordered versions; then releases a
    batch's first and second tensor before its wait; then a tensor all-reduced and waited for on
    a side stream, released by the stream that made it with and without ordering."""
    group, peer = ps.dp_group, ps.dp_group.ranks[1 - ps.dp_group.rank]
    out = {}
    checker = StreamChecker()
    with checker.installed():
        t = torch.ones(4)
        work = group.all_reduce(t, async_op=True)
        t.sum()                                 # read before the collective's write is waited
        work.wait()
        out["all_reduce"] = list(checker.violations)
        checker.violations.clear()
        s, r = torch.arange(4.0), torch.empty(4)
        transfers = [("send", s, peer), ("recv", r, peer)] if ps.rank == 0 else \
            [("recv", r, peer), ("send", s, peer)]
        works = group.batch_isend_irecv(transfers)
        s.zero_()                               # overwritten while the send may still read it
        for w in works:
            w.wait()
        out["send"] = list(checker.violations)
        checker.violations.clear()
        t = torch.ones(4)                       # the ordered versions: no violation
        work = group.all_reduce(t, async_op=True)
        work.wait()
        t.sum()
        group.all_reduce(t)                     # synchronous: ordered at once
        t.sum()
        s, r = torch.arange(4.0), torch.empty(4)
        for w in group.batch_isend_irecv(transfers[:0] + [(k, s if k == "send" else r, p)
                                                          for k, _, p in transfers]):
            w.wait()
        s.zero_(), r.sum()
        out["ordered collectives"] = list(checker.violations)
        # HCCL keeps a batch's first tensor alive until it completes, the others not: released
        # before the wait, the first is the backend's to keep, the second is a race
        for which in (0, 1):
            checker.violations.clear()
            s, r = torch.arange(4.0), torch.empty(4)
            posted = [(k, s if k == "send" else r, p) for k, _, p in transfers]
            works = group.batch_isend_irecv(posted)
            streams.released(posted[which][1])
            for w in works:
                w.wait()
            out[f"released {which}"] = list(checker.violations)
        # NCCL stashes an async collective's tensors until wait(), then lets them go: a tensor
        # the compute stream made, all-reduced and waited for on a side stream, goes back to
        # compute's pool at its release (after the wait) or at the wait (released before it)
        side = streams.side_stream("side", "cpu")
        for case in ("released after the wait", "released before the wait", "ordered"):
            checker.violations.clear()
            t = torch.ones(4)
            streams.wait_stream(side, streams.current_stream("cpu"))
            with streams.use(side):
                work = group.all_reduce(t, async_op=True)
                if case == "released before the wait":
                    streams.released(t)
                work.wait()
            if case == "ordered":
                streams.wait_stream(streams.current_stream("cpu"), side)
            if case != "released before the wait":
                streams.released(t)
            out[case] = list(checker.violations)
    return out


def test_collective_violations():
    for out in run_distributed(_collective_checks, grid=RankGrid(dp=2)):
        (message,) = out["all_reduce"]
        assert message.startswith("read after an unordered write")
        assert "'comm:dp'" in message and "'compute'" in message and "all_reduce on dp" in message
        (message,) = out["send"]
        assert message.startswith("write after an unordered read") and "send on pp" not in message
        assert "send on dp" in message and "zero_ on stream 'compute'" in message
        assert out["ordered collectives"] == []
        assert out["released 0"] == []          # (the suite's rules are HCCL's)
        (message,) = out["released 1"]
        assert message.startswith("released while in use") and "on stream 'comm:dp'" in message
        for case in ("released after the wait", "released before the wait"):
            (message,) = out[case]
            assert message.startswith("released while in use"), (case, message)
            assert "all_reduce on dp on stream 'comm:dp'" in message and "'compute'" in message
        assert out["ordered"] == []


# what only parallel/runtime/streams.py may create or call: threads, thread pools, streams and
# events between them (by the fully qualified name an import gives them), and the stream methods
_MADE_BY_THE_STREAM_API = {
    "threading.Thread", "threading.Timer", "_thread.start_new_thread", "_thread.start_new",
    "concurrent.futures.ThreadPoolExecutor", "concurrent.futures.thread.ThreadPoolExecutor",
    "multiprocessing.pool.ThreadPool", "multiprocessing.dummy.Pool",
    "torch.Stream", "torch.Event"}
_DEVICE_MODULES = ("cuda", "npu", "xpu", "mps")
_STREAM_METHODS = ("record_stream", "wait_stream")


def _qualified(node: ast.AST, names: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` resolved through the file's imports (None: not a dotted name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([names.get(node.id, node.id), *reversed(parts)])


def _stream_api_bypasses(source: str) -> list[str]:
    """Where ``source`` names a thread, a thread pool, a stream or an event of its own, or calls a
    tensor's or a stream's own record_stream / wait_stream (as "line: name")."""
    tree = ast.parse(source)
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                names[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"

    def forbidden(name: str) -> bool:
        parts = name.split(".")
        return name in _MADE_BY_THE_STREAM_API or (
            len(parts) >= 3 and parts[0] == "torch" and parts[1] in _DEVICE_MODULES
            and parts[-1] in ("Stream", "Event"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.lineno}: {node.module}.{a.name}" for a in node.names
                      if forbidden(f"{node.module}.{a.name}")}
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = _qualified(node, names)
            if name is not None and forbidden(name):
                found.add(f"{node.lineno}: {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _STREAM_METHODS \
                and _qualified(node.func.value, names) != "parallel.runtime.streams":
            found.add(f"{node.lineno}: .{node.func.attr}(")
    return sorted(found)


def test_the_stream_api_scan_sees_every_spelling():
    planted = """
import threading, torch
import torch.cuda as tc
from threading import Thread
from concurrent.futures import ThreadPoolExecutor as Pool
from multiprocessing.pool import ThreadPool
from parallel.runtime import streams
class Worker(threading.Thread): pass
threading.Timer(1.0, print).start()
s = torch.cuda.Stream(); e = tc.Event(); torch.npu.Stream(); torch.Stream("cpu")
x.record_stream(s); s.wait_stream(s)
streams.record_stream(x, s); streams.wait_stream(s, s)
threading.current_thread(); torch.cuda.stream(s); torch.cuda.current_stream()
"""
    assert sorted(_stream_api_bypasses(planted)) == sorted([
        "4: threading.Thread", "5: concurrent.futures.ThreadPoolExecutor",
        "6: multiprocessing.pool.ThreadPool", "8: threading.Thread", "9: threading.Timer",
        "10: torch.cuda.Stream", "10: torch.cuda.Event", "10: torch.npu.Stream", "10: torch.Stream",
        "11: .record_stream(", "11: .wait_stream("])


def test_side_streams_and_device_threads_come_from_the_stream_api():
    """Nothing outside parallel/runtime/streams.py creates a side stream, an event between streams,
    a worker thread or a record_stream call, so the checker sees every ordering (the heartbeat's
    thread touches no device object; engine/device/ keeps its own timing events)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    allowed = {"parallel/runtime/streams.py", "parallel/runtime/stream_check.py",
               "parallel/runtime/heartbeat.py"}
    found = []
    for package in ("engine", "models", "parallel", "kernels"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in allowed or rel.startswith("engine/device/"):
                continue
            found += [f"{rel}:{where}" for where in _stream_api_bypasses(path.read_text())]
    assert not found, found


def test_the_current_stream_needs_its_device():
    """Without a device, a stream, or a thread bound to a device there is no current stream to
    name: on an accelerator a "cpu" guess would be a stream with nothing behind it, and every wait
    on it a no-op (the optimizer offload's copies were once ordered that way)."""
    with pytest.raises(ValueError, match="no device given and none bound to this thread"):
        streams.current_stream()
    with pytest.raises(ValueError, match="no device given"):
        streams.record_event()
    assert streams.current_stream("cpu").name == streams.COMPUTE
    side = streams.side_stream("side", "cpu")
    with streams.use(side):
        assert streams.current_stream() is side
    event = streams.record_event(side)
    streams.wait_event(event)  # on the current stream of the event's device
    seen = []
    thread = streams.start_thread("bound", lambda: seen.append(streams.current_stream().device),
                                  "cpu")
    thread.join()
    assert seen == [torch.device("cpu")]
