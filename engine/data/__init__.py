"""Data for training: tokenizers, prepared token corpora, the built-in corpus and the global sampler.

``build_data`` is the one entry point the trainer needs: it picks mock data, a prepared corpus given by
``--data-path``, or the built-in corpus, and returns train/valid datasets with their tokenizer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from engine.data.corpus import builtin_corpus
from engine.data.indexed import MockDataset, TokenDataset, collate, split_sizes
from engine.data.prepare import prepare
from engine.data.sampler import GlobalBatchSampler
from engine.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer

MOCK_NUM_SAMPLES = 2**20  # mock samples are generated on demand, so this only bounds the index space

__all__ = ["DataBundle", "build_data", "TokenDataset", "MockDataset", "collate", "GlobalBatchSampler",
           "load_tokenizer", "ByteTokenizer", "BPETokenizer", "prepare", "builtin_corpus"]


@dataclass
class DataBundle:
    """Train and validation datasets plus what the model and text generation need to know about them."""

    train: TokenDataset | MockDataset
    valid: TokenDataset | MockDataset
    tokenizer: ByteTokenizer | BPETokenizer | None  # None for mock data
    vocab_size: int
    prefix: str | None  # the prepared corpus; None for mock data


def build_data(data_path: str | None, seq_length: int, seed: int, mock: bool = False,
               vocab_size: int | None = None, tokenizer: str = "bpe:8192",
               cache_dir: str | os.PathLike | None = None, valid_fraction: float = 0.02) -> DataBundle:
    """Mock data, the prepared corpus at ``data_path``, or (neither given) the built-in stdlib corpus.

    ``seed`` only shapes mock tokens; sample order is the sampler's job. ``tokenizer`` only applies to
    the built-in corpus (a prepared corpus carries its own). A given ``vocab_size`` must match the data.
    """
    if mock:
        if data_path is not None:
            raise ValueError("mock data and a data path exclude each other: drop --mock-data or --data-path")
        if vocab_size is None:
            raise ValueError("mock data needs a vocabulary size: pass --vocab-size")
        num_train, num_valid = split_sizes(MOCK_NUM_SAMPLES, valid_fraction)
        train = MockDataset(vocab_size, seq_length, num_train, seed)
        valid = MockDataset(vocab_size, seq_length, num_valid, seed, start=num_train)
        return DataBundle(train, valid, None, vocab_size, None)

    prefix = data_path if data_path is not None else builtin_corpus(tokenizer, cache_dir)
    train = TokenDataset(prefix, seq_length, "train", valid_fraction)
    valid = TokenDataset(prefix, seq_length, "valid", valid_fraction)
    if vocab_size is not None and vocab_size != train.vocab_size:
        raise ValueError(f"vocab size {vocab_size} does not match the data at {train.prefix}, tokenized with "
                         f"{train.tokenizer_spec} ({train.vocab_size} tokens): drop --vocab-size or set it "
                         f"to {train.vocab_size}")
    return DataBundle(train, valid, load_tokenizer(train.prefix), train.vocab_size, train.prefix)
