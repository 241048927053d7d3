"""The prepared-data format and the datasets that read it.

A prepared corpus is Megatron-LM's indexed dataset plus two small gridtron files:
  PREFIX.bin, PREFIX.idx  the tokens and their index (``megatron.py``): every document's tokens
                          followed by the end-of-text token; uint16 below 65500 ids, else int32.
                          Data made by Megatron-LM's ``tools/preprocess_data.py`` is the same.
  PREFIX.json             what the tokens mean: tokenizer spec, vocab_size, eot_id, counts, inputs
                          (absent for Megatron's own data: the tokenizer then comes from
                          --tokenizer-model or --vocab-size)
  PREFIX.tokenizer.json   the tokenizer (HF JSON) for BPE and Hugging Face tokenizers
The .bin and .idx are renamed into place before the .json is written.

The older gridtron layout (``PREFIX.bin`` + a ``PREFIX.json`` of format gridtron-tokens-v1 listing
document offsets) is still read; ``python -m engine.data convert PREFIX`` turns it into the format
above without rewriting the tokens.

Samples are non-overlapping windows of seq_length+1 tokens (inputs plus shifted labels) over the
concatenated documents of one split (``splits.py``: documents, not windows, are assigned to train,
validation and test), so no window crosses from one split into another.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from engine.data.errors import PREPARE_AGAIN, DataError, bad_token, read_json
from engine.data.megatron import IndexedTokens, is_indexed, megatron_dtype, write_index, write_indexed
from engine.data.splits import SPLITS, document_split, parse_split
from engine.data.tokenizer import strip_data_suffix
from engine.data.tokenizer_base import atomic_write_text

FORMAT = "gridtron-data-v2"
LEGACY_FORMAT = "gridtron-tokens-v1"
LOSS_COUNT_CHUNK = 1 << 24  # tokens per step of the pass that tabulates --eod-mask-loss counts


def token_dtype(vocab_size: int) -> np.dtype:
    return megatron_dtype(vocab_size)


def write_documents(prefix: str | os.PathLike, docs: Iterable[list[int]], tokenizer,
                    extra: dict | None = None) -> dict:
    """Stream token lists into PREFIX.bin/.idx (each followed by EOT), then write PREFIX.json."""
    dtype = token_dtype(tokenizer.vocab_size)
    eot = tokenizer.eot_id
    num_docs, num_tokens = write_indexed(prefix, ([*ids, eot] for ids in docs), dtype)
    meta = {"format": FORMAT, "tokenizer": tokenizer.spec, "vocab_size": tokenizer.vocab_size,
            "eot_id": eot, "dtype": dtype.name, "num_tokens": num_tokens, "num_docs": num_docs,
            **(extra or {})}
    atomic_write_text(f"{prefix}.json", json.dumps(meta))
    return meta


def read_meta(prefix: str | os.PathLike) -> dict | None:
    """PREFIX.json (gridtron's description of the tokens), or None when there is none."""
    path = Path(f"{strip_data_suffix(str(prefix))}.json")
    if not path.is_file():
        return None
    meta = read_json(path)
    if meta.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise DataError(f"{path} is not a gridtron data description (format {meta.get('format')!r})"
                        f": {PREPARE_AGAIN}")
    needed = REQUIRED_META[meta["format"]]
    if (missing := [k for k in needed if k not in meta]):
        raise DataError(f"{path} lacks {', '.join(missing)}: {PREPARE_AGAIN}")
    vocab, eot = meta["vocab_size"], meta["eot_id"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1 or \
            not isinstance(eot, int) or isinstance(eot, bool) or not 0 <= eot < vocab:
        raise DataError(f"{path}: vocab_size {vocab!r} and eot_id {eot!r} must be integers with "
                        f"0 <= eot_id < vocab_size: {PREPARE_AGAIN}")
    return meta


REQUIRED_META = {FORMAT: ("tokenizer", "vocab_size", "eot_id"),
                 LEGACY_FORMAT: ("tokenizer", "vocab_size", "eot_id", "dtype", "num_tokens", "doc_offsets")}


def read_index(prefix: str | os.PathLike) -> dict:
    """The description of prepared data; raises when there is no data at ``prefix``."""
    prefix = strip_data_suffix(str(prefix))
    meta = read_meta(prefix)
    if meta is None and not is_indexed(prefix):
        raise FileNotFoundError(
            f"no prepared data at {prefix!r} (expected {prefix}.bin and {prefix}.idx): create it with "
            f"python -m engine.data prepare --input YOUR_TEXT --output {prefix}")
    if meta is None:
        docs = IndexedTokens(prefix)
        meta = {"format": "megatron", "tokenizer": None, "vocab_size": None, "eot_id": None,
                "dtype": docs.dtype.name, "num_tokens": docs.num_tokens, "num_docs": docs.num_docs}
    return meta


class Documents:
    """Memory-mapped tokens with per-document (start, length) arrays, from either layout."""

    def __init__(self, prefix: str):
        self.prefix = strip_data_suffix(str(prefix))
        self.meta = read_meta(self.prefix)
        if is_indexed(self.prefix):
            docs = IndexedTokens(self.prefix)
            self.tokens = docs.tokens                                  # (N,)
            self.starts, self.lengths = docs.document_bounds()         # (D,), (D,)
        elif self.meta is not None and self.meta["format"] == LEGACY_FORMAT:
            bin_path = Path(f"{self.prefix}.bin")
            dtype = np.dtype(self.meta["dtype"])
            expected = self.meta["num_tokens"] * dtype.itemsize
            if not bin_path.is_file() or bin_path.stat().st_size != expected:
                raise ValueError(f"{bin_path} does not match {self.prefix}.json: prepare the data again")
            self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(self.meta["num_tokens"],))
            offsets = np.asarray(self.meta["doc_offsets"], dtype=np.int64)
            self.starts, self.lengths = offsets[:-1], np.diff(offsets)
        else:
            read_index(self.prefix)  # raises the "no prepared data" error
            raise ValueError(f"{self.prefix}.json describes a corpus whose {self.prefix}.idx is "
                             f"missing: prepare the data again")
        self.num_docs = len(self.starts)
        if self.num_docs == 0 or int(self.lengths.sum()) == 0:
            raise DataError(f"{self.prefix}.bin holds no tokens ({self.num_docs} documents): "
                            f"{PREPARE_AGAIN} from non-empty text")

    def document_of(self, position: int) -> int:
        """The document holding token ``position`` of the .bin."""
        return int(np.searchsorted(self.starts, position, side="right")) - 1


def first_bad_id(tokens: np.ndarray, vocab_size: int) -> int | None:
    """The position in ``tokens`` of the first id outside 0..vocab_size-1, or None when all fit.
    Negative ids exist only in the signed .bin dtypes (int8..int64, e.g. -1 padding written by
    another tool); they would pass a max() check and train on a wrong target at TP>1."""
    if not len(tokens):
        return None
    negative = tokens.dtype.kind == "i" and int(tokens.min()) < 0
    if not negative and int(tokens.max()) < vocab_size:
        return None
    return int(np.argmax((tokens >= vocab_size) | (tokens < 0)))


def check_ids(docs: Documents, vocab_size: int, limit: int) -> None:
    """DataError when a token id among the first ``limit`` tokens is outside the vocabulary, too
    large or negative (the start-up check; TokenDataset checks every document's ids as it reads
    them)."""
    head = docs.tokens[:limit]                                                    # (<= limit,)
    if (pos := first_bad_id(head, vocab_size)) is not None:
        raise bad_token(f"{docs.prefix}.bin", docs.document_of(pos), int(head[pos]), vocab_size)


def open_tokens(prefix: str | os.PathLike) -> tuple[np.memmap, dict]:
    """The memory-mapped tokens of prepared data and its description."""
    docs = Documents(str(prefix))
    return docs.tokens, read_index(prefix)


def convert_legacy(prefix: str, output: str | None = None) -> dict:
    """Write the Megatron index for data in the old layout (tokens kept; int32 when they were uint32)."""
    prefix = strip_data_suffix(prefix)
    output = strip_data_suffix(output) if output else prefix
    meta = read_meta(prefix)
    if meta is None or meta["format"] != LEGACY_FORMAT:
        raise ValueError(f"{prefix} is not in the old gridtron-tokens-v1 layout: nothing to convert")
    docs = Documents(prefix)
    dtype = token_dtype(meta["vocab_size"])
    if output != prefix or dtype != docs.tokens.dtype:
        tmp = Path(f"{output}.bin.tmp-{os.getpid()}")
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        np.asarray(docs.tokens, dtype=dtype).tofile(tmp)
        os.replace(tmp, f"{output}.bin")
    lengths = docs.lengths
    write_index(f"{output}.idx", dtype, lengths, np.arange(len(lengths) + 1))
    tok = Path(f"{prefix}.tokenizer.json")
    if output != prefix and tok.is_file():
        atomic_write_text(f"{output}.tokenizer.json", tok.read_text(encoding="utf-8"))
    new = {k: v for k, v in meta.items() if k != "doc_offsets"}
    new.update(format=FORMAT, dtype=dtype.name)
    atomic_write_text(f"{output}.json", json.dumps(new))
    return new


class TokenDataset:
    """Windows of ``seq_length + 1`` tokens over the documents of one split: ``ds[i] -> (s+1,)``.

    ``splits`` is the ``--split`` string and ``seed`` the run's seed (the document shuffle). The
    vocabulary facts come from PREFIX.json; for Megatron's own data pass them in ``meta``.
    """

    def __init__(self, prefix: str | os.PathLike, seq_length: int, split: str = "train",
                 splits: str = "969,30,1", seed: int = 0, meta: dict | None = None,
                 shared: tuple | None = None):
        """``shared``: (Documents, document_split's ids by split) of this prefix, opened once for
        all three splits (``TokenDataset.all_splits``)."""
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        docs, by_split = shared or (Documents(str(prefix)), None)
        self.prefix, self.tokens, self.split = docs.prefix, docs.tokens, split
        self.documents = docs
        info = {**(docs.meta or {}), **(meta or {})}
        self.vocab_size = info.get("vocab_size")
        self.eot_id = info.get("eot_id")
        self.tokenizer_spec = info.get("tokenizer")
        if by_split is None:
            by_split = document_split(docs.num_docs, parse_split(splits), seed)
        ids = by_split[split]  # (D_split,)
        self.doc_ids = ids
        self._starts = docs.starts[ids]                                          # (D_split,)
        self._cum = np.concatenate([[0], np.cumsum(docs.lengths[ids], dtype=np.int64)])  # (D_split+1,)
        self.seq_length = seq_length
        self.num_samples = int(self._cum[-1] // (seq_length + 1))
        self._loss_tables: dict[int, np.ndarray] = {}  # loss_token_table's, by end-of-document id
        if split == "train" and self.num_samples < 1:
            raise ValueError(f"{self.prefix}: the training split ({len(ids)} of {docs.num_docs} "
                             f"documents, {int(self._cum[-1])} tokens) holds no sample of seq_length+1 "
                             f"= {seq_length + 1} tokens: use a smaller --seq-length or more data")

    @classmethod
    def all_splits(cls, prefix, seq_length: int, splits: str = "969,30,1", seed: int = 0,
                   meta: dict | None = None) -> dict[str, "TokenDataset"]:
        """The train, valid and test datasets of ``prefix``, its documents opened and split once."""
        docs = Documents(str(prefix))
        shared = (docs, document_split(docs.num_docs, parse_split(splits), seed))
        return {name: cls(prefix, seq_length, name, splits, seed, meta, shared) for name in SPLITS}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        w = self.seq_length + 1
        pos, end = i * w, (i + 1) * w
        k = int(np.searchsorted(self._cum, pos, side="right")) - 1
        pieces = []
        while pos < end:  # a window spans the tail of one document and the heads of the next
            begin = int(self._starts[k]) + pos - int(self._cum[k])
            take = min(end, int(self._cum[k + 1])) - pos
            piece = self.tokens[begin: begin + take]                              # (take,)
            if self.vocab_size is not None and (bad := first_bad_id(piece, self.vocab_size)) is not None:
                raise bad_token(f"{self.prefix}.bin", int(self.doc_ids[k]), int(piece[bad]),
                                self.vocab_size)
            pieces.append(piece)
            pos += take
            k += 1
        return torch.from_numpy(np.concatenate(pieces).astype(np.int64))  # (s+1,)

    def loss_token_table(self, eod_id: int) -> np.ndarray:
        """(num_samples,) int32: each sample's input tokens (its first s) that are not ``eod_id``,
        the --eod-mask-loss count (``packing.loss_mask``). Built lazily at the first call, by one
        vectorised pass over the split's span of the .bin in chunks of LOSS_COUNT_CHUNK tokens,
        then kept for the dataset's life."""
        if eod_id not in self._loss_tables:
            self._loss_tables[eod_id] = self._count_loss_tokens(eod_id)
        return self._loss_tables[eod_id]

    def loss_tokens(self, indices, eod_id: int) -> int:
        """Unmasked input tokens over the samples ``indices`` (a list or array): a sum over the
        table, no sample read."""
        table = self.loss_token_table(eod_id)
        return int(table[np.asarray(indices, dtype=np.int64)].sum(dtype=np.int64))

    def _count_loss_tokens(self, eod_id: int) -> np.ndarray:
        """The table of ``loss_token_table``: s per sample, less each E among its inputs. Every E of
        the .bin is placed in the split's token stream (documents of other splits dropped) and
        then in its window; an E at a window's last position is a label only and keeps its count."""
        s, w = self.seq_length, self.seq_length + 1
        table = np.full(self.num_samples, s, dtype=np.int32)                     # (num_samples,)
        if not self.num_samples:
            return table
        docs = self.documents
        stream_start = np.full(docs.num_docs, -1, dtype=np.int64)  # -1: another split's document
        stream_start[self.doc_ids] = self._cum[:-1]                              # (D,)
        lo = int(self._starts.min())
        hi = int((self._starts + docs.lengths[self.doc_ids]).max())
        for a in range(lo, hi, LOSS_COUNT_CHUNK):
            at = a + np.flatnonzero(docs.tokens[a: min(a + LOSS_COUNT_CHUNK, hi)] == eod_id)  # (E,)
            doc = np.searchsorted(docs.starts, at, side="right") - 1                            # (E,)
            local = at - docs.starts[doc]
            pos = stream_start[doc] + local                                     # in the split's stream
            mine = (stream_start[doc] >= 0) & (local < docs.lengths[doc]) & \
                (pos < self.num_samples * w) & (pos % w < s)
            window, n = np.unique(pos[mine] // w, return_counts=True)
            table[window] -= n.astype(np.int32)
        return table


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
