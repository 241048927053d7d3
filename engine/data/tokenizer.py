"""Tokenizers: a byte-level one that needs no training and a byte-level BPE trained with HF `tokenizers`.

Both expose the same small interface (``spec``, ``vocab_size``, ``eot_id``, ``encode``, ``encode_batch``,
``decode``) so the data pipeline, the trainer and text generation never care which one is in use.
A tokenizer is named by a *spec* string: ``"byte"`` or ``"bpe:<vocab size>"``; a Hugging Face tokenizer
given by ``--tokenizer-model`` has the spec ``"hf"`` (``hf_tokenizer.py``). A trained BPE tokenizer is
persisted as HF's JSON file next to the prepared data (``PREFIX.tokenizer.json``), never pickled.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from engine.data.errors import PREPARE_AGAIN, DataError, read_json, tokenizer_from_file
from engine.data.tokenizer_base import HFBacked, atomic_write_text

EOT_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus one end-of-text token (id 256). Lossless for any text, no training."""

    spec = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids; the end-of-text token becomes its text and broken UTF-8 becomes U+FFFD."""
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eot_id:
                out.append(pending.decode("utf-8", errors="replace"))
                out.append(EOT_TEXT)
                pending = bytearray()
            elif 0 <= i < 256:
                pending.append(i)
            else:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary (0..256)")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


class BPETokenizer(HFBacked):
    """Byte-level BPE (GPT-2 style pre-tokenization) backed by a HF ``tokenizers.Tokenizer``.

    ``vocab_size`` is the size actually learned, which is below the requested size when the training text
    is too small to yield that many merges; ``spec`` keeps the requested size. As with GPT-2, the literal
    text ``<|endoftext|>`` inside a document encodes to the end-of-text token.
    """

    def __init__(self, hf_tokenizer, spec: str):
        self._tok = hf_tokenizer
        self.spec = spec
        eot = hf_tokenizer.token_to_id(EOT_TEXT)
        if eot is None:
            raise ValueError(f"BPE tokenizer has no {EOT_TEXT!r} token: it was not trained by gridtron")
        self.eot_id = eot
        self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        """Write HF's own JSON form (loadable by ``tokenizers.Tokenizer.from_file``) atomically."""
        atomic_write_text(path, self._tok.to_str())

    @classmethod
    def load(cls, path: str | os.PathLike, spec: str | None = None) -> "BPETokenizer":
        """Load a saved tokenizer; ``spec`` (kept in the data index) defaults to the learned size."""
        tok = tokenizer_from_file(path)
        return cls(tok, spec or f"bpe:{tok.get_vocab_size(with_added_tokens=True)}")


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``"byte"`` -> ("byte", None); ``"bpe:8192"`` -> ("bpe", 8192). Anything else is a clear error."""
    if spec == "byte":
        return "byte", None
    kind, _, size = spec.partition(":")
    if kind == "bpe" and size.isdigit() and int(size) > 257:
        return "bpe", int(size)
    raise ValueError(f"unknown tokenizer spec {spec!r}: use 'byte' or 'bpe:N' with N > 257 "
                     f"(for example 'bpe:8192')")


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE on ``texts``. Every byte is in the initial alphabet, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return BPETokenizer(tok, f"bpe:{vocab_size}")


def tokenizer_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.tokenizer.json")


def load_tokenizer(prefix_or_spec: str | os.PathLike):
    """Return the tokenizer named by a spec (``"byte"``) or stored with prepared data at ``prefix``.

    A BPE spec alone cannot be loaded: BPE must be trained, which ``python -m engine.data prepare`` does.
    """
    s = str(prefix_or_spec)
    if s == "byte":
        return ByteTokenizer()
    prefix = strip_data_suffix(s)
    index = Path(f"{prefix}.json")
    if index.is_file():
        meta = read_json(index)
        if not isinstance(meta.get("tokenizer"), str) or not isinstance(meta.get("eot_id"), int):
            raise DataError(f"{index} names no tokenizer (keys tokenizer and eot_id): {PREPARE_AGAIN}")
        spec = meta["tokenizer"]
        if spec == "byte":
            return ByteTokenizer()
        if spec == "hf":
            from engine.data.hf_tokenizer import HFTokenizer
            return HFTokenizer.from_file(tokenizer_path(prefix), eot_id=meta["eot_id"], fix=PREPARE_AGAIN)
        return BPETokenizer.load(tokenizer_path(prefix), spec)
    if tokenizer_path(prefix).is_file():
        return BPETokenizer.load(tokenizer_path(prefix))
    if s.startswith("bpe:"):
        raise ValueError(f"cannot load {s!r} by itself: a BPE tokenizer is trained when data is prepared; "
                         f"pass the prepared data prefix instead (python -m engine.data prepare ...)")
    raise FileNotFoundError(f"no tokenizer found for {s!r}: expected 'byte' or a prepared data prefix "
                            f"with {prefix}.json (run python -m engine.data prepare --output {prefix} ...)")


def strip_data_suffix(path: str) -> str:
    """Accept ``PREFIX``, ``PREFIX.json``, ``.bin``, ``.idx`` or ``.tokenizer.json`` for a prefix."""
    for suffix in (".tokenizer.json", ".json", ".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path
