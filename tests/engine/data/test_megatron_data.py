"""Megatron-LM's indexed dataset format, document splits and blends.

A hand-made ``.idx`` with a known byte layout (MMIDIDX header, version 1, dtype code, sequence
lengths, pointers, document indices) is read back and rewritten byte for byte; prepared data
round-trips through the memory map; the old gridtron layout is read and converted; splits assign
whole documents; blends draw their weights' shares and give every layout the same samples.
"""
import json
import struct

import numpy as np
import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.data import build_data, prepare
from engine.data.indexed import Documents, TokenDataset, convert_legacy
from engine.data.megatron import IndexedTokens, write_index, write_indexed
from engine.data.sampler import BlendedSampler
from engine.data.splits import document_split, split_sizes
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

# 3 sequences of int32 tokens; document 0 is sequences 0 and 1 (sentence-split), document 1 is 2
TOKENS = [10, 11, 12, 20, 21, 30, 31, 32, 33]
IDX = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([4]) + struct.pack("<QQ", 3, 3)
       + struct.pack("<3i", 3, 2, 4) + struct.pack("<3q", 0, 12, 20) + struct.pack("<3q", 0, 2, 3))


def hand_made(tmp_path, name="hand"):
    prefix = tmp_path / name
    (tmp_path / f"{name}.bin").write_bytes(np.asarray(TOKENS, dtype="<i4").tobytes())
    (tmp_path / f"{name}.idx").write_bytes(IDX)
    return str(prefix)


def test_hand_made_index_with_known_bytes(tmp_path):
    prefix = hand_made(tmp_path)
    assert len(IDX) == 9 + 8 + 1 + 8 + 8 + 3 * 4 + 3 * 8 + 3 * 8 == 94
    docs = IndexedTokens(prefix)
    assert docs.dtype == np.int32 and (docs.num_docs, docs.num_tokens) == (2, 9)
    assert docs.sequence_lengths.tolist() == [3, 2, 4]
    assert docs.sequence_pointers.tolist() == [0, 12, 20]
    assert docs.document_indices.tolist() == [0, 2, 3]
    starts, lengths = docs.document_bounds()
    assert starts.tolist() == [0, 5] and lengths.tolist() == [5, 4]
    # our writer produces exactly these bytes
    write_index(tmp_path / "again.idx", np.int32, [3, 2, 4], [0, 2, 3])
    assert (tmp_path / "again.idx").read_bytes() == IDX
    # Megatron data carries no vocabulary: --vocab-size (NullTokenizer) gives it
    bundle = build_data(prefix, seq_length=3, seed=0, vocab_size=64, split="1,0,0")
    assert bundle.tokenizer is None and bundle.vocab_size == 64
    assert [bundle.train[i].tolist() for i in range(len(bundle.train))] == [[10, 11, 12, 20], [21, 30, 31, 32]]
    with pytest.raises(ValueError, match="carries no tokenizer.*--tokenizer-model"):
        build_data(prefix, seq_length=3, seed=0)
    with pytest.raises(ValueError, match=r"hand.bin: document 0 holds token id 20, outside the 20-token "
                                         r"vocabulary \(a corrupt file, or data made with another "
                                         r"tokenizer\)"):
        build_data(prefix, seq_length=3, seed=0, vocab_size=20)


def test_damaged_indexes_are_named(tmp_path):
    prefix = hand_made(tmp_path)
    (tmp_path / "hand.idx").write_bytes(IDX + bytes(3))  # multimodal: one mode byte per sequence
    assert IndexedTokens(prefix).num_docs == 2
    (tmp_path / "hand.idx").write_bytes(IDX[:-8])
    with pytest.raises(ValueError, match="truncated or not a Megatron index"):
        IndexedTokens(prefix)
    (tmp_path / "hand.idx").write_bytes(b"NOTANIDX" + IDX[8:])
    with pytest.raises(ValueError, match="no MMIDIDX header"):
        IndexedTokens(prefix)
    (tmp_path / "hand.idx").write_bytes(IDX)
    (tmp_path / "hand.bin").write_bytes(np.asarray(TOKENS[:5], dtype="<i4").tobytes())
    with pytest.raises(ValueError, match="do not belong together"):
        IndexedTokens(prefix)


def test_prepare_round_trip_through_the_memory_map(tmp_path):
    texts = [f"document {i}: " + "words " * (3 + 7 * i) for i in range(6)]
    for i, t in enumerate(texts):
        (tmp_path / f"d{i}.txt").write_text(t)
    meta = prepare([tmp_path], tmp_path / "out" / "c", "byte")
    assert (meta["format"], meta["num_docs"], meta["dtype"]) == ("gridtron-data-v2", 6, "uint16")
    docs = IndexedTokens(str(tmp_path / "out" / "c"))
    assert isinstance(docs.tokens, np.memmap)
    for arr in (docs.sequence_lengths, docs.sequence_pointers, docs.document_indices):
        assert isinstance(arr, np.ndarray) and not arr.flags.owndata  # views of the mapped index
    starts, lengths = docs.document_bounds()
    for i, text in enumerate(texts):
        got = docs.tokens[starts[i]: starts[i] + lengths[i]].tolist()
        assert got == list(text.encode()) + [256]


def test_old_layout_is_read_and_converted(tmp_path):
    tokens = np.arange(40, dtype=np.uint16) % 250
    (tmp_path / "old.bin").write_bytes(tokens.tobytes())
    index = {"format": "gridtron-tokens-v1", "tokenizer": "byte", "vocab_size": 257, "eot_id": 256,
             "dtype": "uint16", "num_tokens": 40, "num_docs": 3, "doc_offsets": [0, 10, 25, 40]}
    (tmp_path / "old.json").write_text(json.dumps(index))
    prefix = str(tmp_path / "old")
    before = [TokenDataset(prefix, 7, "train", "1,0,0")[i].tolist() for i in range(5)]
    convert_legacy(prefix)
    assert (tmp_path / "old.bin").read_bytes() == tokens.tobytes()  # tokens kept as they were
    docs = Documents(prefix)
    assert docs.starts.tolist() == [0, 10, 25] and docs.lengths.tolist() == [10, 15, 15]
    assert "doc_offsets" not in json.loads((tmp_path / "old.json").read_text())
    assert [TokenDataset(prefix, 7, "train", "1,0,0")[i].tolist() for i in range(5)] == before


def test_splits_assign_whole_documents(tmp_path):
    # document d is 12 copies of token d, so every window says which documents it came from
    prefix = str(tmp_path / "docs")
    write_indexed(prefix, ([d] * 12 for d in range(50)), np.uint16)
    assert split_sizes(50, (0.8, 0.1, 0.1)) == [40, 5, 5]
    assert split_sizes(10, (0.969, 0.03, 0.001)) == [10, 0, 0]
    ids = document_split(50, (0.8, 0.1, 0.1), seed=7)
    assert [len(ids[s]) for s in ("train", "valid", "test")] == [40, 5, 5]
    assert sorted(np.concatenate(list(ids.values())).tolist()) == list(range(50))
    assert document_split(50, (0.8, 0.1, 0.1), seed=7)["valid"].tolist() == ids["valid"].tolist()
    assert document_split(50, (0.8, 0.1, 0.1), seed=8)["valid"].tolist() != ids["valid"].tolist()
    bundle = build_data(prefix, seq_length=7, seed=7, vocab_size=64, split="8,1,1")
    for name in ("train", "valid", "test"):
        ds = getattr(bundle, name)
        seen = {t for i in range(len(ds)) for t in ds[i].tolist()}
        assert seen <= set(ids[name].tolist()) and len(ds) == len(ids[name]) * 12 // 8


def _member_datasets(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_indexed(a, ([1] * 9 for _ in range(30)), np.uint16)   # 30 samples of seq_length 8
    write_indexed(b, ([2] * 9 for _ in range(70)), np.uint16)   # 70 samples
    return a, b


def test_blend_proportions_and_every_layout_draws_the_same_samples(tmp_path):
    a, b = _member_datasets(tmp_path)
    bundle = build_data(["0.3", a, "0.7", b], seq_length=8, seed=5, vocab_size=8, split="1,0,0")
    g, steps = 32, 200
    sampler = bundle.sampler("train", g, seed=5)
    assert isinstance(sampler, BlendedSampler) and sampler.weights == pytest.approx([0.3, 0.7])
    from_a = [sum(i < 30 for i in sampler.global_batch(k)) for k in range(steps)]
    assert all(abs(n - 0.3 * g) < 1 for n in from_a)  # floor(9.6) or its ceiling, every step
    assert abs(sum(from_a) / (g * steps) - 0.3) < 1 / steps
    first = [i for k in range(3) for i in sampler.global_batch(k) if i < 30]
    assert len(first) == sampler.consumed(3)[0] <= 30 and len(set(first)) == len(first)  # an epoch
    batch = sampler.global_batch(3)
    assert {bundle.train[i][0].item() for i in batch} == {1, 2}  # tokens of both members
    for dp, mbs in [(1, 32), (2, 4), (4, 8), (8, 1)]:
        fresh = bundle.sampler("train", g, seed=5)
        for k in (0, 7, 150):
            got = [i for r in range(dp) for mb in fresh.micro_batches(k, r, dp, mbs) for i in mb]
            assert got == sampler.global_batch(k), (dp, mbs, k)
    assert build_data(["0.3", a, "0.7", b], 8, 6, vocab_size=8).sampler("train", g, 6).global_batch(0) \
        != sampler.global_batch(0)
    sizes = build_data([a, b], seq_length=8, seed=5, vocab_size=8, split="1,0,0").sampler("train", g, 5)
    assert sizes.weights == pytest.approx([0.3, 0.7])  # prefixes alone: weighted by their samples


def test_data_path_and_split_flags():
    assert parse_args(["--data-path", "corpus"]).data.data_path == ["corpus"]
    cfg = parse_args(["--data-path", "0.3", "a", "0.7", "b", "--split", "98,2,0"])
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"] and cfg.data.split == "98,2,0"
    with pytest.raises(ConfigError, match="weights and prefixes must alternate"):
        parse_args(["--data-path", "0.3", "a", "b"])
    with pytest.raises(ConfigError, match="mixes weighted and unweighted"):
        parse_args(["--data-path", "a", "0.5", "b"])
    with pytest.raises(ConfigError, match="up to three non-negative weights"):
        parse_args(["--split", "1,2,3,4"])


BLEND_ARGS = ["--no-progress", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
              "--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2",
              "--global-batch-size", "8", "--train-iters", "3", "--vocab-size", "8", "--split", "1,0,0",
              "--lr-warmup-iters", "0", "--peak-tflops", "1"]


def _blend_losses(ps, argv):
    trainer = Trainer(parse_args(argv))
    try:
        return [r["loss"] for r in trainer.train().records]
    finally:
        trainer.close()


def test_blended_training_is_layout_independent(tmp_path):
    a, b = _member_datasets(tmp_path)
    argv = BLEND_ARGS + ["--data-path", "0.3", a, "0.7", b]
    serial = Trainer(parse_args(argv))
    want = [r["loss"] for r in serial.train().records]
    serial.close()
    got = run_distributed(_blend_losses, grid=RankGrid(dp=2), args=(argv,), timeout_s=60)
    assert len(want) == 3, want
    for losses in got:
        assert len(losses) == len(want), (losses, want)
        assert all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(losses, want)), (losses, want)
