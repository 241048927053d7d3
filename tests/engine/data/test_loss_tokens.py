"""--eod-mask-loss counts of a global batch come from a per-sample table each prepared dataset
builds once (TokenDataset.loss_token_table; a blend looks up its members'): the same counts as
reading the samples, and no sample read per step."""
import numpy as np
import pytest

from engine.data import ByteTokenizer, TokenDataset, build_data
from engine.data import indexed
from engine.data.indexed import write_documents
from engine.data.packing import count_loss_tokens

E = ByteTokenizer().eot_id
SEQ = 11  # samples of 12 tokens


def corpus(path, seed, num_docs=40):
    """Documents of 0..30 byte ids with E's inside them too (each also ends with E): E's fall at
    every window position, the last (a label only) included."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        doc = rng.integers(97, 123, int(rng.integers(0, 31)))
        doc[rng.random(len(doc)) < 0.15] = E
        docs.append(doc.tolist())
    write_documents(str(path), docs, ByteTokenizer())
    return str(path)


def read_count(ds, indices):
    """The --eod-mask-loss rule applied to the samples as read: inputs (all but the last token of
    each window) that are not E."""
    return sum(int((ds[int(i)][:-1] != E).sum()) for i in indices)


def steps_of(bundle, split, steps=12, gbs=8):
    sampler = bundle.sampler(split, gbs, seed=3)
    return [sampler.global_batch(step) for step in range(steps)]


@pytest.mark.parametrize("chunk", [5, 1 << 24])  # a pass in many small chunks, and in one
def test_counts_equal_reading_the_samples(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(indexed, "LOSS_COUNT_CHUNK", chunk)
    prefix = corpus(tmp_path / "a", seed=0)
    bundle = build_data(prefix, SEQ, seed=1, split="6,3,1")
    for split in ("train", "valid"):
        ds = getattr(bundle, split)
        assert ds.loss_token_table(E).tolist() == [read_count(ds, [i]) for i in range(len(ds))]
        for batch in steps_of(bundle, split):
            assert count_loss_tokens(ds, batch, E) == read_count(ds, batch)
    some = [i for i in range(len(bundle.train)) if int((bundle.train[i][:-1] == E).sum())]
    assert some  # the corpus does mask tokens


def test_blend_counts_equal_reading_the_samples(tmp_path):
    a, b = corpus(tmp_path / "a", seed=0), corpus(tmp_path / "b", seed=1, num_docs=25)
    bundle = build_data(["0.7", a, "0.3", b], SEQ, seed=1, split="8,2,0")
    for split in ("train", "valid"):
        ds = getattr(bundle, split)
        assert len(ds.datasets) == 2
        for batch in steps_of(bundle, split):
            assert count_loss_tokens(ds, batch, E) == read_count(ds, batch)


def test_a_step_reads_no_sample(tmp_path, monkeypatch):
    a, b = corpus(tmp_path / "a", seed=0), corpus(tmp_path / "b", seed=1, num_docs=25)
    plain, blend = build_data(a, SEQ, seed=1), build_data(["0.7", a, "0.3", b], SEQ, seed=1)
    expected = {id(bundle): [read_count(bundle.train, batch) for batch in steps_of(bundle, "train")]
                for bundle in (plain, blend)}
    reads = []
    real = TokenDataset.__getitem__

    def counting(self, i):
        reads.append(i)
        return real(self, i)

    monkeypatch.setattr(TokenDataset, "__getitem__", counting)
    for bundle in (plain, blend):
        got = [count_loss_tokens(bundle.train, batch, E) for batch in steps_of(bundle, "train")]
        assert got == expected[id(bundle)]
    assert reads == []  # neither building the tables nor the steps read a sample
