"""Megatron-LM's indexed dataset format (``PREFIX.bin`` + ``PREFIX.idx``), read and written.

``PREFIX.bin`` is every sequence's tokens back to back, in one integer dtype. ``PREFIX.idx`` says
where they are, little-endian, in this order::

    offset  size   field
    0       9      magic b"MMIDIDX\\x00\\x00"
    9       8      version, uint64 = 1
    17      1      dtype code, uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                   7 float32, 8 uint16)
    18      8      sequence count S, uint64
    26      8      document count D + 1, uint64 (the length of the document index array)
    34      4*S    sequence lengths, int32 (tokens)
    ..      8*S    sequence pointers, int64 (byte offset of each sequence in PREFIX.bin)
    ..      8*(D+1) document indices, int64: document d is sequences [idx[d], idx[d+1]); idx[0] = 0
    ..      S      (multimodal files only) sequence modes, int8; ignored here

Megatron's ``tools/preprocess_data.py`` writes one sequence per document (several with
``--split-sentences``) and, with ``--append-eod``, the end-of-document token as each document's last
token. Both files are memory-mapped: nothing per document becomes a Python object when a dataset
is opened; document boundaries come out as numpy arrays.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from engine.data.errors import PREPARE_AGAIN, DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def is_indexed(prefix: str) -> bool:
    return os.path.isfile(f"{prefix}.idx") and os.path.isfile(f"{prefix}.bin")


def write_index(path: str | os.PathLike, dtype: np.dtype, sequence_lengths: np.ndarray,
                document_indices: np.ndarray) -> None:
    """Write a ``.idx`` file for sequences of ``sequence_lengths`` tokens stored back to back."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF:
        raise ValueError(f"dtype {dtype} has no Megatron code; use one of "
                         f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}")
    lengths = np.asarray(sequence_lengths, dtype=np.int32)                  # (S,)
    pointers = np.zeros(len(lengths), dtype=np.int64)                       # (S,)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)                     # (D+1,)
    with open(path, "wb") as fh:
        fh.write(MAGIC)
        fh.write(struct.pack("<Q", VERSION))
        fh.write(struct.pack("<B", CODE_OF[dtype]))
        fh.write(struct.pack("<Q", len(lengths)))
        fh.write(struct.pack("<Q", len(docs)))
        fh.write(lengths.tobytes(order="C"))
        fh.write(pointers.tobytes(order="C"))
        fh.write(docs.tobytes(order="C"))


def write_indexed(prefix: str | os.PathLike, docs: Iterable[list[int]], dtype: np.dtype) -> tuple[int, int]:
    """Stream documents (one sequence each) into PREFIX.bin, then write PREFIX.idx.

    Both are written to temporary names and renamed, the ``.idx`` last, so an index that exists
    always describes a complete token file. Returns (documents, tokens).
    """
    dtype = np.dtype(dtype)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin = bin_path.with_name(f".{bin_path.name}.tmp-{os.getpid()}")
    tmp_idx = idx_path.with_name(f".{idx_path.name}.tmp-{os.getpid()}")
    lengths: list[int] = []
    try:
        with open(tmp_bin, "wb") as fh:
            for ids in docs:
                arr = np.asarray(ids, dtype=dtype)  # (doc_len,)
                fh.write(arr.tobytes(order="C"))
                lengths.append(len(arr))
        if not lengths:
            raise ValueError(f"no documents to write to {bin_path}")
        write_index(tmp_idx, dtype, np.asarray(lengths), np.arange(len(lengths) + 1))
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    return len(lengths), int(sum(lengths))


class IndexedTokens:
    """A memory-mapped Megatron dataset: ``tokens`` (all of PREFIX.bin as one array) and, per
    document, its first token's position and its length (numpy int64 arrays)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
        with open(idx_path, "rb") as fh:
            head = fh.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:9] != MAGIC:
            raise ValueError(f"{idx_path} is not a Megatron index (no MMIDIDX header): prepare the "
                             f"data with python -m engine.data prepare or Megatron's preprocess_data.py")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only version 1 is known")
        code = head[17]
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise ValueError(f"{idx_path} stores {self.dtype} values, not token ids")
        num_seq, num_doc_idx = struct.unpack("<QQ", head[18:34])
        size = os.path.getsize(idx_path)
        need = HEADER_BYTES + 12 * num_seq + 8 * num_doc_idx
        if size not in (need, need + num_seq):  # (+ one mode byte per sequence when multimodal)
            raise ValueError(f"{idx_path} has {size} bytes but its header describes {need}: the file "
                             f"is truncated or not a Megatron index")
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, num_seq, off)           # (S,)
        self.sequence_pointers = np.frombuffer(buf, np.int64, num_seq, off + 4 * num_seq)
        self.document_indices = np.frombuffer(buf, np.int64, num_doc_idx, off + 12 * num_seq)
        if num_doc_idx < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != num_seq:
            raise ValueError(f"{idx_path}: document indices do not span the {num_seq} sequences")
        bin_size = os.path.getsize(bin_path)
        if bin_size == 0 or num_seq == 0:
            raise DataError(f"{bin_path} holds no tokens ({num_seq} sequences in {idx_path}): "
                            f"{PREPARE_AGAIN} from non-empty text")
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize \
            if num_seq else 0
        if bin_size < end or bin_size % self.dtype.itemsize:
            raise ValueError(f"{bin_path} has {bin_size} bytes but {idx_path} points up to byte {end}: "
                             f"the files do not belong together")
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r",
                                shape=(bin_size // self.dtype.itemsize,))           # (N,)
        self.num_docs = num_doc_idx - 1
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))

    def document_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(start token, token count) of every document: two (D,) int64 arrays. A document is the
        contiguous run of its sequences (they are written back to back)."""
        first, last = self.document_indices[:-1], self.document_indices[1:]
        starts_seq = np.append(self.sequence_pointers // self.dtype.itemsize, self.tokens.shape[0])
        ends_seq = np.append(self.sequence_pointers // self.dtype.itemsize
                             + self.sequence_lengths, 0)
        starts = starts_seq[np.minimum(first, len(self.sequence_lengths))]
        # (last - 1) is the document's last sequence; an empty document (first == last) has length 0
        ends = np.where(last > first, ends_seq[np.maximum(last - 1, 0)], starts)
        return starts.astype(np.int64), (ends - starts).astype(np.int64)
