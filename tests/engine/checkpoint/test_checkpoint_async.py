"""Asynchronous checkpoints (--async-save): training runs on while a save is written, the files equal
a synchronous save's byte for byte, `latest` moves only once every rank's files are complete (a
process killed mid-write resumes from the previous checkpoint with the uninterrupted losses), and
SIGTERM (on one rank, or during a background write) stops every rank after the same step, once the
save in flight is complete. A background write that fails on one rank fails every rank."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engine.checkpoint.async_writer as async_writer
import engine.checkpoint.writer as writer
from engine.checkpoint import inspect
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

ROOT = str(Path(__file__).resolve().parents[3])
TINY = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1"]
RUN = TINY + ["--train-iters", "6", "--save-interval", "2", "--keep-last", "3", "--timeout-s", "60"]


def _run(argv, cls=Trainer):
    trainer = cls(parse_args(argv))
    try:
        result = trainer.train()
        return [r["loss"] for r in result.records], [r["save_blocking_s"] for r in result.records], \
            result.stopped
    finally:
        trainer.close()


def _read_files(ckpt: str) -> dict:
    """Every file of a checkpoint, the index parsed (without the async_save flag itself)."""
    out = {}
    for name in sorted(os.listdir(ckpt)):
        data = open(os.path.join(ckpt, name), "rb").read()
        if name == "index.json":
            data = json.loads(data)
            data["config"]["checkpoint"].pop("async_save")
            data["config"]["explicit"] = [k for k in data["config"]["explicit"] if k != "async_save"]
        out[name] = data
    return out


def async_against_sync(ps, root):
    """dp=2 with ZeRO-1 (every rank writes its own optimizer range, rank 0 the parameters). Each
    rank's background writer of the step-2 save is held until that rank has trained step 4 (so
    the parameters and moments it writes have been updated in place twice since the snapshot);
    events are logged in order."""
    base = RUN + ["--use-distributed-optimizer", "--save", os.path.join(root, "run")]
    out = {"sync": _run(base)}
    dist.barrier()
    if ps.rank == 0:
        os.rename(os.path.join(root, "run"), os.path.join(root, "sync"))
    dist.barrier()

    events, release = [], threading.Event()
    real_write, real_snapshot, real_publish = writer.write_shard, async_writer.snapshot, writer.publish

    def write_shard(tensors, path):
        background = threading.current_thread() is not threading.main_thread()
        if background and "iter_0000002.tmp" in path:
            assert release.wait(60)
        info = real_write(tensors, path)
        events.append(("written" if background else "written by the main thread", path.split(os.sep)[-2]))
        return info

    def snapshot(trainer, step, tmp):
        events.append(("snapshot", step))
        return real_snapshot(trainer, step, tmp)

    def publish(snap):
        events.append(("published", snap.step))
        return real_publish(snap)

    class Logged(Trainer):
        def train_one(self, step):
            record = super().train_one(step)
            latest = os.path.join(root, "run", "latest")
            events.append(("trained", step + 1, os.readlink(latest) if os.path.lexists(latest) else None))
            if step + 1 == 4:
                release.set()
            return record

    patched = [(writer, "write_shard", write_shard), (async_writer, "snapshot", snapshot),
               (writer, "publish", publish)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]
    for mod, name, fn in patched:
        setattr(mod, name, fn)
    try:
        out["async"] = _run(base + ["--async-save"], cls=Logged)
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    out["events"] = events
    dist.barrier()
    if ps.rank == 0:
        os.rename(os.path.join(root, "run"), os.path.join(root, "async"))
    dist.barrier()

    class SigtermOnRank1(Trainer):
        def train_one(self, step):
            if step == 2 and ps.rank == 1:  # during step 3, on one rank only
                os.kill(os.getpid(), signal.SIGTERM)
            return super().train_one(step)

    out["sigterm"] = _run(base + ["--async-save"], cls=SigtermOnRank1)
    out["resumed"] = _run(base + ["--async-save", "--load", os.path.join(root, "run")])

    def failing_write(tensors, path):  # rank 1's background write of the step-4 save fails
        if ps.rank == 1 and "iter_0000004.tmp" in path:
            raise OSError("No space left on device")
        return real_write(tensors, path)

    writer.write_shard = failing_write
    try:
        _run(base + ["--async-save", "--save", os.path.join(root, "failing")])
    except Exception as exc:  # noqa: BLE001 - the test compares the message
        out["failure"] = f"{type(exc).__name__}: {exc}"
    finally:
        writer.write_shard = real_write
    return out


def test_async_save_overlaps_training_and_matches_sync(tmp_path):
    res = run_distributed(async_against_sync, grid=RankGrid(dp=2), args=(str(tmp_path),), timeout_s=120)
    sync_losses, sync_blocking, _ = res[0]["sync"]
    for rank in (0, 1):
        losses, blocking, stopped = res[rank]["async"]
        assert losses == sync_losses and stopped is None  # saving in the background changes nothing
        # the boundary of a save, and each one while it is in flight (polls); step 6 saves
        # synchronously after waiting for step 4's save
        assert [b is not None for b in blocking] == [False, True, True, True, True, True], blocking
    assert [b is not None for b in sync_blocking] == [False, True, False, True, False, True]

    for rank in (0, 1):  # the step-2 files are written only after steps 3 and 4 trained
        ev = res[rank]["events"]
        order = [e for e in ev if e[0] in ("snapshot", "trained", "written")]
        assert order[:6] == [("trained", 1, None), ("trained", 2, None), ("snapshot", 2),
                             ("trained", 3, None), ("trained", 4, None),
                             ("written", "iter_0000002.tmp")], ev
        assert ev.index(("snapshot", 4)) > ev.index(("written", "iter_0000002.tmp"))
    ev0 = res[0]["events"]  # rank 0 publishes step 2 only after both ranks wrote it: at boundary 4
    trained = {e[1]: e[2] for e in ev0 if e[0] == "trained"}
    assert [trained[s] for s in range(1, 6)] == [None, None, None, None, "iter_0000002"], ev0
    assert trained[6] in ("iter_0000002", "iter_0000004")  # step 4's save: published at 5 or 6
    assert [e for e in ev0 if e[0] in ("published", "snapshot")] == [
        ("snapshot", 2), ("published", 2), ("snapshot", 4), ("published", 4), ("published", 6)], ev0

    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    assert sorted(os.listdir(async_dir)) == sorted(os.listdir(sync_dir)) == \
        ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
    for it in ("iter_0000002", "iter_0000004", "iter_0000006"):
        want, got = _read_files(str(sync_dir / it)), _read_files(str(async_dir / it))
        assert sorted(got) == sorted(want) == ["index.json", "rank_00000.safetensors",
                                               "rank_00001.safetensors"]
        for name in want:
            assert got[name] == want[name], (it, name)  # byte for byte (the index: key for key)

    # SIGTERM on rank 1 during step 3: both ranks stop after step 3, once the step-2 save is
    # published, with a final save of step 3 that resumes to the uninterrupted losses
    for rank in (0, 1):
        losses, _, stopped = res[rank]["sigterm"]
        assert losses == sync_losses[:3] and stopped == "stopped by SIGTERM after step 3", res[rank]["sigterm"]
        assert res[rank]["resumed"][0] == sync_losses[3:]
    # a background write that fails on one rank fails both at a later boundary; latest stays at 2
    assert res[0]["failure"].startswith("CheckpointError: the background save of step 4 failed on 1 "
                                        "of 2 ranks (see that rank's log)"), res[0]["failure"]
    assert "failed on 1 of 2 ranks: No space left on device" in res[1]["failure"], res[1]["failure"]
    assert os.readlink(tmp_path / "failing" / "latest") == "iter_0000002"


def _worker(args, env_extra, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env_extra)
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.fault_worker", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc, what, timeout=120):
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}: {proc.communicate()}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _steps(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path).read().splitlines() if line.endswith("}")]


@pytest.fixture()
def one_thread():
    """Train here with the subprocesses' single thread, so that losses compare bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_killed_mid_write_resumes_from_previous_checkpoint(tmp_path, one_thread):
    root, metrics, marker = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "writing"
    args = RUN + ["--save", str(root), "--async-save", "--metrics-file", str(metrics)]
    proc = _worker(args, {"GRIDTRON_TEST_BLOCK_SAVE": f"4:{marker}"})
    try:  # the step-4 writer holds after its first file while steps 5 and 6 train; then: SIGKILL
        _wait_for(lambda: marker.exists() and len(_steps(metrics)) >= 5, proc, "step 5")
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert os.readlink(root / "latest") == "iter_0000002"
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004.tmp", "latest"]
    assert os.listdir(root / "iter_0000004.tmp") == ["rank_00000.safetensors"]  # no JSON, no index
    killed = [r["loss"] for r in _steps(metrics)]
    reference, _, _ = _run(TINY + ["--train-iters", "6"])  # uninterrupted, no checkpoints
    assert killed[:5] == reference[:5]
    resumed, _, _ = _run(args)  # no --load: resumes from latest (step 2) and cleans up
    assert resumed == reference[2:]
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]


def test_sigterm_or_sigint_during_background_save_waits_for_it(tmp_path):
    """SIGTERM, and Ctrl-C's SIGINT alike (two runs at once), during a background save: the run
    waits for the writer, saves the step it stopped after, prints one line and exits (0 after
    SIGTERM, 130 after SIGINT), without a traceback or an abort."""
    procs = {}
    for sig in (signal.SIGTERM, signal.SIGINT, "twice"):
        run = tmp_path / getattr(sig, "name", sig)
        root, metrics = run / "ck", run / "m.jsonl"
        marker, release = run / "writing", run / "release"
        args = TINY + ["--train-iters", "40", "--save-interval", "2", "--keep-last", "5", "--save",
                       str(root), "--async-save", "--metrics-file", str(metrics)]
        procs[sig] = (_worker(args, {"GRIDTRON_TEST_BLOCK_SAVE": f"2:{marker}:{release}"}), run)
    try:
        for sig, (proc, run) in procs.items():
            _wait_for((run / "writing").exists, proc, "the step-2 save to start writing")
            proc.send_signal(signal.SIGINT if sig == "twice" else sig)
        time.sleep(1.5)
        for sig, (proc, run) in procs.items():
            assert proc.poll() is None  # still waiting for the step-2 writer
            root = run / "ck"
            assert not (root / "iter_0000002").exists() and not (root / "latest").exists()
            if sig == "twice":  # Ctrl-C again: leave now, abandoning the save in flight
                proc.send_signal(signal.SIGINT)
            else:
                (run / "release").touch()
        done = {sig: proc.communicate(timeout=120) for sig, (proc, _) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
    proc, run = procs.pop("twice")
    err = done["twice"][1]
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("gridtron:") and "SIG" in ln]
    assert len(lines) == 1 and lines[0].startswith("gridtron: stopped by a second SIGINT during "
                                                   "step "), err[-3000:]
    assert lines[0].endswith("without waiting for it or a save in flight; latest checkpoint: none "
                             "saved"), lines
    assert sorted(os.listdir(run / "ck")) == ["iter_0000002.tmp"]  # abandoned; nothing published
    for sig, (proc, run) in procs.items():
        err = done[sig][1]
        assert proc.returncode == (0 if sig == signal.SIGTERM else 130), err[-3000:]
        root = run / "ck"
        steps = [r["step"] for r in _steps(run / "m.jsonl")]
        last = steps[-1]
        assert steps == list(range(1, last + 1)) and 2 <= last < 40, steps
        lines = [ln for ln in err.splitlines() if ln.startswith("gridtron:") and "SIG" in ln]
        assert lines == [f"gridtron: stopped by {sig.name} after step {last} (of 40); saved "
                         f"{root / f'iter_{last:07d}'}"], err[-3000:]
        assert "Traceback" not in err and "terminate" not in err, err[-3000:]
        assert os.readlink(root / "latest") == f"iter_{last:07d}"  # the final save at the stop
        assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
        assert inspect(str(root / "iter_0000002"), out=open(os.devnull, "w")) == 0  # verified


def test_async_save_under_the_stream_checker(tmp_path, stream_checker):
    """Training with background saves under the stream-order checker: the copy into the reused
    host buffers, the writer thread's reads of them and the next save's copy are ordered (the
    thread is joined or seen finished before its buffers are written again)."""
    root = tmp_path / "ck"
    _run(TINY + ["--train-iters", "4", "--save-interval", "1", "--keep-last", "2", "--save",
                 str(root), "--async-save"])
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000004", "latest"]
    assert any(name.startswith("gridtron-save-") for name in stream_checker.streams)


def test_latest_moves_only_after_the_steps_metrics_are_on_disk(tmp_path, monkeypatch):
    """A save of step k publishes (latest -> iter_k) only once the metrics file holds the records of
    steps 1..k, fsynced: a run killed after the publication and resumed from it misses no record.
    Synchronous saves (the record of step k is completed at the boundary first) and background
    ones (published steps later)."""
    fsynced = {}  # the metrics file's text at its last fsync
    real_fsync, real_publish = os.fsync, writer.publish

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".jsonl"):
            fsynced[path] = open(path).read()
        return real_fsync(fd)

    published = []

    def publish(snap):
        text = "".join(fsynced.values())
        published.append((snap.step, [json.loads(line)["step"] for line in text.splitlines()]))
        return real_publish(snap)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(writer, "publish", publish)
    for mode in ([], ["--async-save"]):
        fsynced.clear()
        published.clear()
        metrics = tmp_path / f"m{len(mode)}.jsonl"
        argv = TINY + ["--train-iters", "5", "--save-interval", "2", "--keep-last", "3", "--save",
                       str(tmp_path / f"ck{len(mode)}"), "--metrics-file", str(metrics)] + mode
        trainer = Trainer(parse_args(argv))
        try:
            records = trainer.train().records
        finally:
            trainer.close()
        assert [step for step, _ in published] == [2, 4, 5], (mode, published)
        for step, on_disk in published:
            assert on_disk[:step] == list(range(1, step + 1)), (mode, step, on_disk)
        # the file holds exactly the records the run returned (a record written before its own
        # save's publication keeps the blocking time measured up to it)
        assert [json.loads(line) for line in metrics.read_text().splitlines()] == \
            json.loads(json.dumps(records))
        assert [r["save_blocking_s"] is not None for r in records] == \
            ([False, True, False, True, True] if not mode else [False, True, True, True, True])


def test_host_buffers_pin_only_what_a_device_copies():
    """On an accelerator the snapshot's buffers of device tensors are pinned (asynchronous
    copies); those of tensors already in host memory (the offloaded optimizer's state) are not:
    pinned memory is scarce beside the offload and their copy is the host's own either way. On
    the CPU nothing is pinned."""
    device = async_writer.HostBuffers("cuda")        # no device is touched by the decision
    assert device.pins(torch.empty(2, device="meta")) is True
    assert device.pins(torch.zeros(2)) is False
    assert async_writer.HostBuffers("cpu").pins(torch.zeros(2)) is False
    buf = async_writer.HostBuffers("cpu").take({"w": torch.arange(3.0)})["w"]
    assert torch.equal(buf, torch.arange(3.0)) and not buf.is_pinned()


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_host_buffers_are_chunks_of_whole_tensors_kept_between_saves():
    """The buffers of a save are views into chunks of whole tensors, one set per dtype (a
    power-of-two allocator rounds only each dtype's last chunk), hold the values, and are reused
    while the tensors keep their names, shapes and dtypes; another layout gets new ones."""
    rng = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(n, generator=rng).to(dt).view(-1, 1) for i, (n, dt) in enumerate(
        [(200, torch.float32), (300, torch.bfloat16), (300, torch.float32), (64, torch.bfloat16),
         (12, torch.float32), (1, torch.int64), (5, torch.float32)])}
    buffers = async_writer.HostBuffers("cpu", chunk_bytes=4096)
    copies = buffers.take(tensors)
    for k, t in tensors.items():
        assert copies[k].dtype == t.dtype and torch.equal(copies[k], t), k
        assert copies[k].data_ptr() != t.data_ptr()
    # the largest first. fp32, 517 elements: a chunk of 2048 bytes (512 elements: w2, w0, w4),
    # then w6 exactly;
    # bf16, 364: a chunk of 512 bytes cannot hold w1 (300) and w3, so w1 has one of its own
    # size, then w3 exactly; int64 one chunk (host_flat.py's rule)
    chunks = {flat.dtype: [c.numel() for c in flat.chunks] for flat in buffers._flats}
    assert chunks == {torch.float32: [512, 5], torch.bfloat16: [300, 64], torch.int64: [1]}, chunks
    assert copies["w0"].data_ptr() == copies["w2"].data_ptr() + 4 * 300   # one chunk
    assert buffers.allocated_bytes() == (4 * 517 + 2 * 364 + 8, 0)   # nothing unused
    ptrs = {k: c.data_ptr() for k, c in copies.items()}
    tensors["w0"].add_(1)
    again = buffers.take(tensors)
    assert {k: c.data_ptr() for k, c in again.items()} == ptrs     # the same buffers
    assert torch.equal(again["w0"], tensors["w0"])
    tensors["w5"] = torch.zeros(2, dtype=torch.int64)               # another layout: new buffers
    assert buffers.take(tensors)["w5"].shape == (2,)


def test_chunked_buffers_pin_little_more_than_an_8b_ranks_weights():
    """One pinned buffer per tensor is rounded up to a power of two by CUDA's caching host
    allocator: the bf16 weights of the 8B llama of docs/benchmarks.md (32 x 4096, GQA 8 groups,
    ffn 14336, vocabulary 128256) would pin 13.7% more than they hold; in chunks of whole
    tensors, the largest first (async_writer.HostBuffers), 1.5% more."""
    from parallel.dp.host_flat import chunk_layout
    h, kv, f, v = 4096, 1024, 14336, 128256
    layer = [h, h, h * (h + 2 * kv), h * h, 2 * f * h, f * h]   # norms, qkv, out, gate+up, down
    sizes = [v * h] + 32 * layer + [h, v * h]
    _, entries = async_writer.packing(sizes)
    held = 2 * sum(sizes)
    one_each = sum(_pow2_ceil(2 * n) for n in sizes)
    chunked = sum(_pow2_ceil(2 * cap) for _, cap in chunk_layout(entries, 2))
    assert one_each >= 1.13 * held and chunked <= 1.02 * held, (one_each / held, chunked / held)
