import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import engine.data
from engine.data import (BPETokenizer, ByteTokenizer, MockDataset, TokenDataset, build_data, builtin_corpus,
                         collate, load_tokenizer, prepare)
from engine.data import corpus as corpus_mod
from engine.data.indexed import open_tokens, token_dtype
from engine.data.megatron import IndexedTokens
from engine.data.prepare import collect_files
from engine.data.tokenizer import EOT_TEXT, train_bpe

ROOT = Path(__file__).resolve().parents[3]
UNICODE = "naïve café — 日本語のテキスト 🙂\n\tdef f(x):  return x ** 2  # ünïcödé\r\n"
DOCS = [
    "def add(a, b):\n    return a + b\n" * 3,
    "The quick brown fox jumps over the lazy dog.\n" * 4,
    UNICODE,
    "x = [i * i for i in range(10)]\nprint(x)\n",
]


@pytest.fixture()
def text_dir(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (root / "sub" / "b.md").write_text(DOCS[1], encoding="utf-8")
    (root / "sub" / "c.py").write_text(DOCS[2], encoding="utf-8")
    (root / "skipped.bin").write_bytes(b"\x00\x01 not text")
    (root / "empty.txt").write_text("", encoding="utf-8")
    (root / "z.jsonl").write_text(json.dumps({"text": DOCS[3]}) + "\n\n", encoding="utf-8")
    return root


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == UNICODE
    assert tok.decode(ids + [tok.eot_id] + tok.encode("next")) == UNICODE + EOT_TEXT + "next"
    assert (tok.vocab_size, tok.eot_id, tok.spec) == (257, 256, "byte")
    assert load_tokenizer("byte").encode("hé") == tok.encode("hé")


def test_bpe_tokenizer_round_trip_and_reload(tmp_path):
    tok = train_bpe(DOCS[:2] * 5, vocab_size=400)
    assert tok.spec == "bpe:400" and tok.vocab_size <= 400 and tok.eot_id == 0
    for text in DOCS + ["unseen: Ωμέγα ∑ 🚀 \x00 end"]:  # any byte sequence, seen in training or not
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode(DOCS[0])) < len(DOCS[0].encode())  # merges were learned
    assert tok.encode_batch(DOCS) == [tok.encode(d) for d in DOCS]
    tok.save(tmp_path / "t.tokenizer.json")
    again = BPETokenizer.load(tmp_path / "t.tokenizer.json", "bpe:400")
    assert again.encode(UNICODE) == tok.encode(UNICODE) and again.vocab_size == tok.vocab_size


@pytest.mark.parametrize("spec", ["byte", "bpe:300"])
def test_prepare_then_read_back(tmp_path, text_dir, spec):
    prefix = tmp_path / "out" / "data"
    index = prepare([text_dir], prefix, spec)
    tok = load_tokenizer(prefix)
    assert tok.spec == spec and index["tokenizer"] == spec
    assert Path(f"{prefix}.tokenizer.json").is_file() == (spec != "byte")

    tokens, index = open_tokens(prefix)
    assert tokens.dtype == np.uint16 and index["dtype"] == "uint16"
    assert Path(f"{prefix}.idx").is_file()  # Megatron's index beside the tokens
    # Sorted path order, empty and non-text files skipped, one document per jsonl line.
    expected = []
    for doc in [DOCS[0], DOCS[1], DOCS[2], DOCS[3]]:
        expected += tok.encode(doc) + [tok.eot_id]
    assert tokens.tolist() == expected
    starts, lengths = IndexedTokens(str(prefix)).document_bounds()
    offsets = [*starts.tolist(), int(starts[-1] + lengths[-1])]
    assert index["num_docs"] == 4 and offsets[-1] == index["num_tokens"] == len(expected)
    for i, doc in enumerate([DOCS[0], DOCS[1], DOCS[2], DOCS[3]]):
        assert tokens[offsets[i + 1] - 1] == tok.eot_id
        assert tok.decode(tokens[offsets[i]: offsets[i + 1] - 1].tolist()) == doc
    assert [t for t in expected if t == tok.eot_id] == [tok.eot_id] * 4


def test_prepare_reuses_a_tokenizer_and_caps_input(tmp_path, text_dir):
    prepare([text_dir], tmp_path / "train", "bpe:300")
    index = prepare([text_dir / "a.txt"], tmp_path / "valid", str(tmp_path / "train"))
    assert index["tokenizer"] == "bpe:300"
    assert load_tokenizer(tmp_path / "valid").encode(UNICODE) == load_tokenizer(tmp_path / "train").encode(UNICODE)
    capped = prepare([text_dir], tmp_path / "capped", "byte", max_bytes=len(DOCS[0].encode()) + 10)
    assert capped["num_docs"] == 1 and capped["num_tokens"] == len(DOCS[0].encode()) + 1
    assert token_dtype(65499) == np.uint16 and token_dtype(65500) == np.int32  # Megatron's choice


def test_prepare_errors_say_what_to_change(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*--input"):
        prepare([tmp_path / "missing"], tmp_path / "out", "byte")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus.*pass non-empty"):
        prepare([tmp_path / "empty"], tmp_path / "out", "byte")
    (tmp_path / "empty" / "some.txt").write_text("some text")
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        prepare([tmp_path / "empty"], tmp_path / "out", "bpe:x")
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        prepare([tmp_path / "empty"], tmp_path / "out", str(tmp_path / "no_such_prefix"))
    with pytest.raises(FileNotFoundError, match="engine.data prepare"):
        TokenDataset(tmp_path / "nothing", 8)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.data", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli(tmp_path, text_dir):
    out = run_cli("prepare", "--input", text_dir / "a.txt", text_dir / "sub", "--output", tmp_path / "cli",
                  "--tokenizer", "byte")
    assert out.returncode == 0, out.stderr
    assert "3 documents" in out.stdout
    tokens, index = open_tokens(tmp_path / "cli")
    assert index["num_docs"] == 3
    assert bytes(tokens[: len(DOCS[0].encode())].astype(np.uint8)) == DOCS[0].encode()

    missing = run_cli("prepare", "--input", tmp_path / "nope", "--output", tmp_path / "x")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "hollow").mkdir()
    empty = run_cli("prepare", "--input", tmp_path / "hollow", "--output", tmp_path / "x")
    assert empty.returncode == 2 and "empty corpus" in empty.stderr
    assert not Path(f"{tmp_path / 'x'}.json").exists()
    assert not Path(f"{tmp_path / 'x'}.idx").exists()


def test_token_dataset_windows_over_a_split(tmp_path, text_dir):
    prefix = tmp_path / "data"
    prepare([text_dir], prefix, "byte")
    tokens, index = open_tokens(prefix)
    s = 16
    starts, lengths = IndexedTokens(str(prefix)).document_bounds()
    train = TokenDataset(prefix, s, "train", splits="1,0,0")
    assert train.doc_ids.tolist() == [0, 1, 2, 3] and len(train) == index["num_tokens"] // (s + 1)
    flat = [t for i in range(len(train)) for t in train[i].tolist()]
    assert flat == tokens[: len(train) * (s + 1)].tolist()  # non-overlapping windows, in order
    # two of four documents: windows run over those documents' tokens only, in document order
    half = TokenDataset(prefix, s, "train", splits="1,1,0", seed=3)
    other = TokenDataset(prefix, s, "valid", splits="1,1,0", seed=3)
    assert sorted([*half.doc_ids, *other.doc_ids]) == [0, 1, 2, 3] and len(half.doc_ids) == 2
    stream = np.concatenate([tokens[starts[d]: starts[d] + lengths[d]] for d in half.doc_ids])
    assert [t for i in range(len(half)) for t in half[i].tolist()] == stream[: len(half) * (s + 1)].tolist()
    assert train[0].dtype == torch.long and train[0].shape == (s + 1,)
    assert (train.vocab_size, train.eot_id, train.tokenizer_spec) == (257, 256, "byte")
    assert collate(train, [2, 0]).shape == (2, s + 1)
    with pytest.raises(IndexError):
        train[len(train)]
    assert len(TokenDataset(prefix, s, "valid")) == 0  # 969,30,1 of 4 documents leaves none
    with pytest.raises(ValueError, match="smaller --seq-length"):
        TokenDataset(prefix, index["num_tokens"], "train")


def test_mock_dataset_is_deterministic_per_index():
    a = MockDataset(100, 8, num_samples=50, seed=3)
    b = MockDataset(100, 8, num_samples=50, seed=3)
    assert torch.equal(a[7], b[7]) and not torch.equal(a[7], a[8])
    assert not torch.equal(a[7], MockDataset(100, 8, 50, seed=4)[7])
    assert torch.equal(MockDataset(100, 8, 10, seed=3, start=7)[0], a[7])
    batch = collate(a, range(50))
    assert batch.shape == (50, 9) and batch.dtype == torch.long
    assert 0 <= batch.min() and batch.max() < 100


def test_build_data_mock_and_prepared(tmp_path, text_dir):
    mock = build_data(None, seq_length=8, seed=1, mock=True, vocab_size=64)
    assert mock.vocab_size == 64 and mock.tokenizer is None and mock.prefix is None
    assert mock.valid.start == len(mock.train)  # validation samples follow the training ones
    with pytest.raises(ValueError, match="--vocab-size"):
        build_data(None, seq_length=8, seed=1, mock=True)

    prepare([text_dir], tmp_path / "data", "byte")
    bundle = build_data(str(tmp_path / "data"), seq_length=8, seed=0, vocab_size=257, split="2,1,1")
    assert bundle.vocab_size == 257 and bundle.tokenizer.spec == "byte"
    assert len(bundle.train) > 0 and len(bundle.valid) >= 1
    with pytest.raises(ValueError, match="set it to 257"):
        build_data(str(tmp_path / "data"), seq_length=8, seed=0, vocab_size=300)


def test_builtin_corpus_builds_once_and_is_reused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    prefix = builtin_corpus("bpe:512", cache_dir=cache, max_bytes=300_000)
    tok = load_tokenizer(prefix)
    tokens, index = open_tokens(prefix)
    assert index["tokenizer"] == "bpe:512" and tok.vocab_size == 512
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in prefix and "bpe512" in prefix
    # The first document is the first stdlib .py file in sorted order, outside the skipped directories.
    first = corpus_mod.stdlib_dir() / "__future__.py"
    _, lengths = IndexedTokens(prefix).document_bounds()
    assert tok.decode(tokens[: lengths[0] - 1].tolist()) == first.read_text(encoding="utf-8")
    assert 0 < index["num_files"] and [p.name for p in cache.iterdir()] == [Path(prefix).parent.name]
    files = collect_files([corpus_mod.stdlib_dir()], (".py",), corpus_mod.SKIP_DIRS)
    assert len(files) > 100 and not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)

    def no_prepare(*args, **kwargs):
        raise AssertionError("the cached corpus was prepared again")

    monkeypatch.setattr(corpus_mod, "prepare", no_prepare)
    assert builtin_corpus("bpe:512", cache_dir=cache, max_bytes=300_000) == prefix
    monkeypatch.setattr(engine.data, "builtin_corpus", functools.partial(builtin_corpus, max_bytes=300_000))
    bundle = build_data(None, seq_length=32, seed=0, tokenizer="bpe:512", cache_dir=cache, split="8,2,0")
    assert bundle.prefix == prefix and bundle.vocab_size == 512 and len(bundle.valid) >= 1


def test_first_build_of_the_builtin_corpus_shows_progress(tmp_path, capsys):
    builtin_corpus("byte", cache_dir=tmp_path, max_bytes=50_000, progress=True)
    err = capsys.readouterr().err
    assert "building the built-in corpus (first run only" in err and "tokenizing corpus" in err
    builtin_corpus("byte", cache_dir=tmp_path, max_bytes=50_000, progress=True)
    assert capsys.readouterr().err == ""  # cached: nothing to show
