"""Data for training: tokenizers, prepared token corpora (Megatron's indexed format), blends, splits,
the built-in corpus and the global samplers.

``build_data`` is the one entry point the trainer needs: it picks mock data, the prepared corpora
given by ``--data-path`` (one prefix, or a weighted blend), or the built-in corpus, splits each by
documents (``--split``) and returns train/valid/test datasets with their tokenizer and samplers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from engine.data.blend import BlendedDataset, normalise, parse_data_path
from engine.data.corpus import builtin_corpus
from engine.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_tokenizer
from engine.data.errors import DataError
from engine.data.indexed import MockDataset, TokenDataset, check_ids, collate, read_meta
from engine.data.prepare import prepare
from engine.data.sampler import BlendedSampler, GlobalBatchSampler
from engine.data.splits import SPLITS
from engine.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, strip_data_suffix

MOCK_NUM_SAMPLES = 2**20  # mock samples are generated on demand, so this only bounds the index space
MOCK_VALID_FRACTION = 0.02
CHECKED_TOKENS = 16 * 2**20  # token ids checked against the vocabulary at start-up (then per read)

__all__ = ["DataBundle", "DataError", "build_data", "TokenDataset", "MockDataset", "BlendedDataset", "collate",
           "GlobalBatchSampler", "BlendedSampler", "load_tokenizer", "load_hf_tokenizer",
           "ByteTokenizer", "BPETokenizer", "HFTokenizer", "prepare", "builtin_corpus"]


@dataclass
class DataBundle:
    """Train, validation and test datasets plus what the model and text generation need to know."""

    train: object
    valid: object
    test: object
    tokenizer: object | None  # None for mock data and for Megatron data without a tokenizer
    vocab_size: int
    prefix: str | None        # the (first) prepared corpus; None for mock data
    prefixes: list[str]
    tokenizer_file: str | None = None  # the HF JSON behind the tokenizer, when there is one

    def sampler(self, split: str, global_batch_size: int, seed: int) -> GlobalBatchSampler:
        """The seeded sampler of one split: a plain one, or a BlendedSampler for a blend."""
        ds = getattr(self, split)
        if len(ds) == 0:
            raise ValueError(f"the {split} split is empty ({', '.join(self.prefixes)}): give it "
                             f"documents with --split (e.g. 969,30,1) or use more data")
        if isinstance(ds, BlendedDataset):
            return BlendedSampler(ds.sizes, ds.weights, global_batch_size, seed)
        return GlobalBatchSampler(len(ds), global_batch_size, seed)


def _mock(seq_length: int, seed: int, vocab_size: int | None) -> DataBundle:
    """Mock data has no documents, so --split does not apply: the last MOCK_VALID_FRACTION of the
    index space is validation (and test) data, the rest training data."""
    if vocab_size is None:
        raise ValueError("mock data needs a vocabulary size: pass --vocab-size")
    n_valid = int(MOCK_NUM_SAMPLES * MOCK_VALID_FRACTION)
    n_train = MOCK_NUM_SAMPLES - n_valid
    train = MockDataset(vocab_size, seq_length, n_train, seed)
    valid = MockDataset(vocab_size, seq_length, n_valid, seed, start=n_train)
    return DataBundle(train, valid, valid, None, vocab_size, None, [])


def _describe(prefix: str, external, vocab_size: int | None) -> dict:
    """Vocabulary facts of one prefix: from its PREFIX.json, else from the tokenizer flags, else
    from --vocab-size (Megatron's own data carries none)."""
    meta = read_meta(prefix)
    if meta is not None:
        info = {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_id")}
        if external is not None and external.vocab_size != meta["vocab_size"]:
            raise ValueError(f"--tokenizer-model has {external.vocab_size} tokens but {prefix} was "
                             f"tokenized with {meta['tokenizer']} ({meta['vocab_size']} tokens): drop "
                             f"the tokenizer flags or prepare the data with that tokenizer")
        return info
    if external is not None:
        return {"tokenizer": external.spec, "vocab_size": external.vocab_size, "eot_id": external.eot_id}
    if vocab_size is not None:
        return {"tokenizer": None, "vocab_size": vocab_size, "eot_id": None}
    raise ValueError(f"{prefix} carries no tokenizer (Megatron's preprocessed data does not): pass the "
                     f"tokenizer it was made with, --tokenizer-model DIR (or --tokenizer-type "
                     f"GPT2BPETokenizer --vocab-file --merge-file), or --vocab-size")


def build_data(data_path: str | list[str] | None, seq_length: int, seed: int, mock: bool = False,
               vocab_size: int | None = None, tokenizer: str = "bpe:8192",
               cache_dir: str | os.PathLike | None = None, split: str = "969,30,1",
               tokenizer_model: str | None = None, tokenizer_type: str | None = None,
               vocab_file: str | None = None, merge_file: str | None = None,
               progress: bool = False) -> DataBundle:
    """Mock data, the prepared corpora of ``data_path`` (a prefix or Megatron's blend list), or
    (neither given) the built-in stdlib corpus.

    ``seed`` shapes mock tokens and the document split; sample order is the sampler's job.
    ``tokenizer`` only applies to the built-in corpus. A given ``vocab_size`` must match the data.
    """
    if mock:
        if data_path:
            raise ValueError("mock data and a data path exclude each other: drop --mock-data or --data-path")
        return _mock(seq_length, seed, vocab_size)
    entries = parse_data_path(data_path)
    if entries is None:
        entries = [(None, builtin_corpus(tokenizer, cache_dir, progress=progress))]
    external = resolve_tokenizer(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    prefixes = [strip_data_suffix(p) for _, p in entries]
    infos = [_describe(p, external, vocab_size) for p in prefixes]
    vocab = infos[0]["vocab_size"]
    for p, info in zip(prefixes[1:], infos[1:]):
        if (info["vocab_size"], info["tokenizer"]) != (vocab, infos[0]["tokenizer"]):
            raise ValueError(f"the blended datasets use different tokenizers: {prefixes[0]} has "
                             f"{infos[0]['tokenizer']} ({vocab} tokens), {p} has {info['tokenizer']} "
                             f"({info['vocab_size']} tokens); prepare them with one tokenizer")
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(f"vocab size {vocab_size} does not match the data at {prefixes[0]}, tokenized with "
                         f"{infos[0]['tokenizer']} ({vocab} tokens): drop --vocab-size or set it to {vocab}")
    per_prefix = [TokenDataset.all_splits(p, seq_length, split, seed, info)
                  for p, info in zip(prefixes, infos)]
    splits = {name: [datasets[name] for datasets in per_prefix] for name in SPLITS}
    for ds in splits["train"]:  # the rest is checked document by document as it is read
        check_ids(ds.documents, vocab, CHECKED_TOKENS)
    weights = [w for w, _ in entries]
    if weights[0] is None:  # prefixes without weights: weighted by their training samples
        weights = [len(d) for d in splits["train"]]
    weights = normalise(weights)
    if len(prefixes) == 1:
        chosen = {name: dss[0] for name, dss in splits.items()}
    else:
        chosen = {name: BlendedDataset(dss, weights, prefixes) for name, dss in splits.items()}
        if len(chosen["train"].datasets) < len(prefixes):
            empty = [p for p, d, w in zip(prefixes, splits["train"], weights) if not len(d) or not w]
            raise ValueError(f"blend member(s) {', '.join(empty)} give no training samples (weight 0 "
                             f"or too little data for --seq-length {seq_length}); drop them")
    if external is not None:
        tok, tok_file = external, external.file
    elif infos[0]["tokenizer"] is not None:
        tok = load_tokenizer(prefixes[0])
        tok_file = f"{prefixes[0]}.tokenizer.json" if os.path.isfile(f"{prefixes[0]}.tokenizer.json") else None
    else:
        tok, tok_file = None, None
    return DataBundle(chosen["train"], chosen["valid"], chosen["test"], tok, vocab, prefixes[0],
                      prefixes, tok_file)
