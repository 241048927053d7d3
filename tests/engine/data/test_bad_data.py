"""Data that cannot be used is one DataError naming the file and what is wrong with it: token ids
outside the vocabulary (checked at start-up over the leading tokens and then document by document
as samples are read), empty data, garbled sidecar JSON, garbled tokenizer files."""
import json

import numpy as np
import pytest

from engine.base import ConfigError
from engine.data import ByteTokenizer, TokenDataset, build_data, load_tokenizer
from engine.data.errors import DataError
from engine.data.hf_tokenizer import load_hf_tokenizer
from engine.data.indexed import Documents, check_ids, read_meta, write_documents
from engine.data.megatron import write_index, write_indexed

SEQ = 15  # samples of 16 tokens
DOC_LEN = 40  # tokens per document, EOT included


@pytest.fixture()
def corrupt(tmp_path):
    """Five byte-tokenized documents; document 3 holds the id 60000 at its 6th token."""
    prefix = str(tmp_path / "c")
    write_documents(prefix, [[97 + d] * (DOC_LEN - 1) for d in range(5)], ByteTokenizer())
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[3 * DOC_LEN + 5] = 60000
    tokens.flush()
    return prefix


def message(prefix, doc=3):
    return (f"{prefix}.bin: document {doc} holds token id 60000, outside the 257-token vocabulary (a "
            f"corrupt file, or data made with another tokenizer): prepare the data again (python -m "
            f"engine.data prepare), or pass the tokenizer it was made with")


def test_a_bad_id_is_found_as_its_document_is_read(corrupt):
    ds = TokenDataset(corrupt, SEQ, "train", splits="1,0,0")
    good = [i for i in range(len(ds)) if (i + 1) * (SEQ + 1) <= 3 * DOC_LEN]  # samples before doc 3
    assert all(int(ds[i].max()) < 257 for i in good)
    with pytest.raises(DataError) as info:
        for i in range(len(ds)):
            ds[i]
    assert str(info.value) == message(corrupt)
    assert isinstance(info.value, ConfigError)  # the run ends with exit 2, no traceback


def test_the_start_up_check_covers_the_leading_tokens(corrupt):
    docs = Documents(corrupt)
    check_ids(docs, 257, 3 * DOC_LEN + 5)  # stops just before the bad token: nothing found
    with pytest.raises(DataError) as info:
        check_ids(docs, 257, 3 * DOC_LEN + 6)
    assert str(info.value) == message(corrupt)
    with pytest.raises(DataError, match="document 3 holds token id 60000"):
        build_data(corrupt, SEQ, seed=1, split="1,0,0")


@pytest.mark.parametrize("dtype,bad", [(np.int16, -1), (np.int32, -1), (np.int64, -7), (np.int32, 100)])
def test_a_signed_corpus_with_a_negative_id_is_refused(tmp_path, dtype, bad):
    """Megatron .bin files may be signed (int8..int64): an id below 0 (e.g. -1 padding) is refused
    at start-up and as its document is read, like an id at or above the vocabulary size."""
    prefix = str(tmp_path / "signed")
    docs = [np.full(DOC_LEN, 10 + d, dtype=dtype) for d in range(5)]
    docs[3][5] = bad
    write_indexed(prefix, docs, dtype)
    text = (f"{prefix}.bin: document 3 holds token id {bad}, outside the 100-token vocabulary (a "
            f"corrupt file, or data made with another tokenizer): prepare the data again (python -m "
            f"engine.data prepare), or pass the tokenizer it was made with")
    check_ids(Documents(prefix), 100, 3 * DOC_LEN + 5)  # stops just before the bad token
    with pytest.raises(DataError) as info:
        check_ids(Documents(prefix), 100, 3 * DOC_LEN + 6)
    assert str(info.value) == text
    with pytest.raises(DataError) as info:
        build_data(prefix, SEQ, seed=1, vocab_size=100, split="1,0,0")
    assert str(info.value) == text
    ds = TokenDataset(prefix, SEQ, "train", splits="1,0,0", meta={"vocab_size": 100, "eot_id": 0})
    first_bad = (3 * DOC_LEN + 5) // (SEQ + 1)  # the sample holding the bad token
    assert all(int(ds[i].min()) >= 10 for i in range(first_bad))
    with pytest.raises(DataError) as info:
        ds[first_bad]
    assert str(info.value) == text


def test_empty_data(tmp_path):
    prefix = str(tmp_path / "e")
    open(prefix + ".bin", "wb").close()
    write_index(prefix + ".idx", np.uint16, np.zeros(0), np.arange(1))
    (tmp_path / "e.json").write_text(json.dumps({"format": "gridtron-data-v2", "tokenizer": "byte",
                                                 "vocab_size": 257, "eot_id": 256}))
    with pytest.raises(DataError) as info:
        Documents(prefix)
    assert str(info.value) == (f"{prefix}.bin holds no tokens (0 sequences in {prefix}.idx): prepare "
                               f"the data again (python -m engine.data prepare) from non-empty text")


@pytest.mark.parametrize("text,problem", [
    ("{not json", " is not valid JSON (Expecting property name enclosed in double quotes at line 1 "
                  "column 2)"),
    ("[1, 2]", " holds a JSON list, not an object"),
    (json.dumps({"format": "gridtron-data-v2"}), " lacks tokenizer, vocab_size, eot_id"),
    (json.dumps({"format": "gridtron-data-v2", "tokenizer": "byte", "vocab_size": 257,
                 "eot_id": 300}), ": vocab_size 257 and eot_id 300 must be integers with 0 <= "
                                  "eot_id < vocab_size"),
    (json.dumps({"format": "other"}), " is not a gridtron data description (format 'other')"),
])
def test_garbled_sidecar(corrupt, text, problem):
    with open(corrupt + ".json", "w") as fh:
        fh.write(text)
    with pytest.raises(DataError) as info:
        read_meta(corrupt)
    assert str(info.value) == (f"{corrupt}.json{problem}: prepare the data again (python -m "
                               f"engine.data prepare)")
    with pytest.raises(DataError, match="prepare the data again"):
        build_data(corrupt, SEQ, seed=1, split="1,0,0")


def test_garbled_tokenizer_files(corrupt, tmp_path):
    meta = json.loads(open(corrupt + ".json").read())
    with open(corrupt + ".json", "w") as fh:
        json.dump({**meta, "tokenizer": "hf"}, fh)
    (tmp_path / "c.tokenizer.json").write_text("garbage{")
    with pytest.raises(DataError) as info:
        load_tokenizer(corrupt)
    assert str(info.value) == (f"{corrupt}.tokenizer.json is not a readable tokenizer file (expected "
                               f"value at line 1 column 1): prepare the data again (python -m "
                               f"engine.data prepare)")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{eos")
    with pytest.raises(DataError, match=r"tokenizer_config.json is not valid JSON .*repair or remove it"):
        load_hf_tokenizer(tmp_path / "hf")
