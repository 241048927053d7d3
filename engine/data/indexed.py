"""The prepared-data format and the datasets that read it.

A prepared corpus is two files (three with BPE):
  PREFIX.bin             every document's tokens followed by the end-of-text token, concatenated;
                         uint16 when the vocabulary fits (< 65536 ids), else uint32; read by memory map
  PREFIX.json            the index: tokenizer spec, vocab_size, eot_id, dtype, num_tokens, doc_offsets
  PREFIX.tokenizer.json  the trained BPE tokenizer (HF JSON)
The .bin is renamed into place before the .json, so an index that exists always describes a complete
token file. Samples are non-overlapping windows of seq_length+1 tokens (inputs plus shifted labels);
the last ``valid_fraction`` of the windows is the validation split, so the two splits share no token.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from engine.data.tokenizer import atomic_write_text, strip_data_suffix

FORMAT = "gridtron-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 2**16 else np.dtype(np.uint32)


def write_documents(prefix: str | os.PathLike, docs: Iterable[list[int]], tokenizer,
                    extra: dict | None = None) -> dict:
    """Stream token lists into PREFIX.bin (each followed by EOT), then write PREFIX.json; return the index."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    bin_path = Path(f"{prefix}.bin")
    tmp = bin_path.with_name(f".{bin_path.name}.tmp-{os.getpid()}")
    offsets = [0]
    try:
        with open(tmp, "wb") as f:
            for ids in docs:
                arr = np.asarray([*ids, tokenizer.eot_id], dtype=dtype)  # (doc_len + 1,)
                arr.tofile(f)
                offsets.append(offsets[-1] + len(arr))
        if len(offsets) == 1:
            raise ValueError(f"no documents to write to {bin_path}")
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer.spec,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype.name,
        "num_tokens": offsets[-1],
        "num_docs": len(offsets) - 1,
        **(extra or {}),
        "doc_offsets": offsets,  # doc i is tokens[off[i]:off[i+1]], its last token is EOT
    }
    atomic_write_text(f"{prefix}.json", json.dumps(index))
    return index


def read_index(prefix: str | os.PathLike) -> dict:
    prefix = strip_data_suffix(str(prefix))
    path = Path(f"{prefix}.json")
    if not path.is_file():
        raise FileNotFoundError(
            f"no prepared data at {prefix!r} (expected {prefix}.json and {prefix}.bin): create it with "
            f"python -m engine.data prepare --input YOUR_TEXT --output {prefix}")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a gridtron token index (format {index.get('format')!r}, "
                         f"expected {FORMAT!r}): prepare the data again")
    return index


def open_tokens(prefix: str | os.PathLike) -> tuple[np.memmap, dict]:
    """Memory-map PREFIX.bin (read-only) after checking its size against the index."""
    prefix = strip_data_suffix(str(prefix))
    index = read_index(prefix)
    dtype = np.dtype(index["dtype"])
    bin_path = Path(f"{prefix}.bin")
    expected = index["num_tokens"] * dtype.itemsize
    if not bin_path.is_file() or bin_path.stat().st_size != expected:
        found = bin_path.stat().st_size if bin_path.is_file() else "no"
        raise ValueError(f"{bin_path} has {found} bytes but {prefix}.json describes {expected}: "
                         f"the files do not belong together; prepare the data again")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(index["num_tokens"],)), index


def split_sizes(num_samples: int, valid_fraction: float) -> tuple[int, int]:
    """(train, valid) sample counts: valid is the last ``valid_fraction`` of samples, at least one."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    num_valid = max(1, int(num_samples * valid_fraction))
    if num_samples - num_valid < 1:
        raise ValueError(f"only {num_samples} sample(s): need at least 2 to hold a train and a validation "
                         f"split; use a smaller --seq-length or more data")
    return num_samples - num_valid, num_valid


class TokenDataset:
    """Windows of ``seq_length + 1`` tokens over a prepared corpus: ``ds[i] -> LongTensor (s+1,)``."""

    def __init__(self, prefix: str | os.PathLike, seq_length: int, split: str = "train",
                 valid_fraction: float = 0.02):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if split not in ("train", "valid"):
            raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
        self.prefix = strip_data_suffix(str(prefix))
        self.tokens, self.index = open_tokens(self.prefix)  # (num_tokens,)
        self.seq_length = seq_length
        self.vocab_size = self.index["vocab_size"]
        self.eot_id = self.index["eot_id"]
        self.tokenizer_spec = self.index["tokenizer"]
        total = self.index["num_tokens"] // (seq_length + 1)
        if total < 2:
            raise ValueError(f"{self.prefix} holds {self.index['num_tokens']} tokens, fewer than two samples "
                             f"of seq_length+1 = {seq_length + 1}: use a smaller --seq-length or more data")
        num_train, num_valid = split_sizes(total, valid_fraction)
        self.start = 0 if split == "train" else num_train  # first window of this split
        self.num_samples = num_train if split == "train" else num_valid

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        w = self.seq_length + 1
        begin = (self.start + i) * w
        return torch.from_numpy(self.tokens[begin: begin + w].astype(np.int64))  # (s+1,)


class MockDataset:
    """Random tokens, deterministic per (seed, start + i): a stand-in with TokenDataset's interface.

    ``start`` offsets the index so a validation set can be the samples after the training ones.
    """

    tokenizer_spec = None

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int, start: int = 0):
        if vocab_size < 2 or seq_length < 1 or num_samples < 1 or seed < 0 or start < 0:
            raise ValueError(f"MockDataset needs vocab_size >= 2, seq_length >= 1, num_samples >= 1 and "
                             f"seed, start >= 0; got {vocab_size}, {seq_length}, {num_samples}, {seed}, {start}")
        self.vocab_size = vocab_size
        self.eot_id = vocab_size - 1
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.start = start

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, self.start + i])
        return torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))


def collate(ds, indices: Iterable[int]) -> torch.Tensor:
    """Stack samples into a batch: (b, s+1)."""
    return torch.stack([ds[int(i)] for i in indices])
