"""Checkpoint I/O in bounded host memory.

- ``write_shard`` (engine/checkpoint/index.py) streams a safetensors file: safetensors' own
  reader (``safe_open``) reads every dtype the checkpoints hold back bit for bit, the index entry's
  checksums match the bytes on disk and locate a damaged tensor, and the process's peak resident
  memory grows by less than a quarter of the file while it is written (safetensors' ``save``
  built the file in memory twice: +2x).
- Loading reads the optimizer state one parameter at a time into its place: the peak resident
  memory of a resume (the distributed optimizer, its state offloaded: already allocated in host
  memory) grows by less than half the state it loads (it held the whole state twice: a clone of
  the live state for its piece list, and every piece read before the first was placed), and the
  moments and masters it leaves in each piece's slices are the saved run's, bit for bit.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors import safe_open

from engine.checkpoint.index import file_damage, write_shard
from engine.config.cli import parse_args
from engine.training.trainer import Trainer


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_every_dtype_reads_back_through_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
               "f16": torch.randn(2, 3, generator=g).half(), "i64": torch.arange(5),
               "i32": torch.arange(6, dtype=torch.int32), "u8": torch.arange(9, dtype=torch.uint8),
               "bool": torch.tensor([True, False, True]),
               "e4m3": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
               "empty": torch.zeros(0, 3), "transposed": torch.randn(4, 6, generator=g).t()}
    path = str(tmp_path / "r.safetensors")
    info = write_shard(tensors, path)
    assert os.path.getsize(path) == info["bytes"] and file_damage(path, info) is None
    with safe_open(path, framework="pt") as fh:
        assert set(fh.keys()) == set(tensors)
        for key, t in tensors.items():
            got = fh.get_tensor(key)
            assert got.dtype == t.dtype and got.shape == t.shape, key
            assert torch.equal(_bits(got), _bits(t)), key
    with open(path, "r+b") as fh:               # one byte of the bf16 tensor flipped
        b, _, _ = info["tensors"]["bf16"]
        fh.seek(b)
        byte = fh.read(1)
        fh.seek(b)
        fh.write(bytes([byte[0] ^ 1]))
    assert "tensor 'bf16' does not match its checksum" in file_damage(path, info)


def _peak_rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's peak RSS reset")
def test_writing_streams_the_file(tmp_path):
    tensors = {f"t{i}": torch.full((8 << 20,), float(i)) for i in range(4)}     # 4 x 32 MiB
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")                            # VmHWM := the current resident size
    before = _peak_rss()
    info = write_shard(tensors, str(tmp_path / "big.safetensors"))
    grown = _peak_rss() - before
    assert info["bytes"] > 128 << 20 and grown < 32 << 20, grown


def _anon_rss() -> int:
    """Resident anonymous memory (the files' mapped pages, which safetensors' reader maps, are
    page cache, not held memory)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:")) * 1024


class _AnonPeak:
    """The largest ``_anon_rss`` seen every millisecond while inside (a sampling thread)."""

    def __enter__(self):
        self.value, self._stop = _anon_rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.value = max(self.value, _anon_rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.value = max(self.value, _anon_rss())


def _optimizer_state(trainer) -> list[tuple]:
    """(name, start, end, exp_avg, exp_avg_sq, master) of each piece of the distributed
    optimizer's shard, copied, read through its slices of the moments (host chunks included)
    and the masters."""
    opt, out = trainer.optimizer, []
    for piece in opt.pieces:
        sl = opt._piece_slice(piece)
        out.append((piece.name, piece.start, piece.end, opt.exp_avg[sl].clone(),
                    opt.exp_avg_sq[sl].clone(), opt.master[sl].clone()))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_a_resume_reads_the_optimizer_state_piece_by_piece(tmp_path):
    flags = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "1024",
             "--num-attention-heads", "8", "--seq-length", "8", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--precision", "fp32", "--no-progress", "--device", "cpu",
             "--use-distributed-optimizer", "--optimizer-cpu-offload", "--run-dir", str(tmp_path)]
    first = Trainer(parse_args(flags + ["--train-iters", "1"]))
    first.train()
    saved = _optimizer_state(first)
    first.close()
    assert all(m.abs().sum() > 0 and v.abs().sum() > 0 for _, _, _, m, v, _ in saved)  # one step moved them
    assert first.optimizer.exp_avg.split == first.optimizer.exp_avg.numel() > 0  # all in host memory
    resumed = Trainer(parse_args(flags + ["--train-iters", "2"]))
    try:
        state = 2 * 4 * sum(p.numel() for c in resumed.chunks for p in c.parameters())  # m, v
        before = _anon_rss()
        with _AnonPeak() as peak:
            assert resumed.maybe_load() == 1
        grown = peak.value - before
        loaded = _optimizer_state(resumed)
    finally:
        resumed.close()
    assert state > 150 << 20 and grown < state // 2, (grown, state)
    # and what it read is the saved run's state, each piece in its place
    assert [x[:3] for x in loaded] == [x[:3] for x in saved]
    for want, got in zip(saved, loaded):
        for key, a, b in zip(("exp_avg", "exp_avg_sq", "master"), want[3:], got[3:]):
            assert torch.equal(a, b), (want[0], want[1], key)


def test_the_state_reader_reads_each_parameter_once_and_keeps_nothing():
    """What the optimizers' loading asks of the state (``name in state``, then ``state[name]``)
    reads a parameter's three tensors once; a read's own KeyError is not taken for a missing
    parameter."""
    from engine.checkpoint.reader import StateReader
    from parallel.dp.optim_common import _covering
    reads = []

    def read(name, a, b, key):
        reads.append((name, key))
        return torch.arange(a, b, dtype=torch.float32) if key != "master" else None
    state = StateReader({"w": (0, 6)}, read)
    got = _covering({"step": 1, "state": state}, {"w": (0, 6)}, "w", 2, 5, 6)
    assert reads == [("w", "exp_avg"), ("w", "exp_avg_sq")] + [("w", "master")]
    assert torch.equal(got["exp_avg"], torch.tensor([2.0, 3.0, 4.0])) and "master" not in got
    assert "v" not in state and list(state) == ["w"] and len(state) == 1

    def broken(name, a, b, key):
        raise KeyError("a key of the file's own table")
    with pytest.raises(KeyError, match="the file's own table"):
        _covering({"step": 1, "state": StateReader({"w": (0, 6)}, broken)}, {}, "w", 0, 6, 6)
