"""Layout-independent initialization (parallel/tensor_parallel/init.py): a weight is the same for
every layout, and a large one drawn in chunks on threads is the same for any thread count."""
from __future__ import annotations

import importlib

import pytest
import torch

from parallel.tensor_parallel import Initializer

init_mod = importlib.import_module("parallel.tensor_parallel.init")


def test_small_weights_are_one_generators_draw():
    """Up to CHUNK_ELEMENTS elements: the (seed, name) generator's randn times the std, exactly
    what every earlier run drew (checkpoints and pinned losses of small models stay valid)."""
    got = Initializer(7, 0.02).full("layers.0.mlp.fc1.weight", (64, 32))
    gen = torch.Generator().manual_seed(init_mod.name_seed(7, "layers.0.mlp.fc1.weight"))
    assert torch.equal(got, torch.randn((64, 32), generator=gen) * 0.02)


def test_large_weights_are_the_same_for_any_thread_count_and_layout(monkeypatch):
    """Above CHUNK_ELEMENTS (made small here) chunk k comes from (seed, name#k): the same values on
    1, 2 or 3 threads, chunks that differ from one another, the std asked for, and TP shards that
    are slices of the whole."""
    monkeypatch.setattr(init_mod, "CHUNK_ELEMENTS", 1000)
    shape = (70, 64)                                               # 4,480 elements: 5 chunks
    draws = [init_mod.normal(3, "embedding.weight", shape, 0.5, threads=t) for t in (1, 2, 3)]
    assert draws[0].shape == shape and all(torch.equal(draws[0], d) for d in draws[1:])
    flat = draws[0].reshape(-1)
    assert not torch.equal(flat[:1000], flat[1000:2000])          # not one stream repeated
    assert abs(flat.std().item() - 0.5) < 0.05
    whole = Initializer(3, 0.5).param("embedding.weight", shape)
    assert torch.equal(whole.data, draws[0])
    halves = [Initializer(3, 0.5).param("embedding.weight", shape, shard_dim=0, rank=r, size=2)
              for r in (0, 1)]
    assert torch.equal(torch.cat([h.data for h in halves]), draws[0])
    assert init_mod.normal(4, "embedding.weight", shape, 0.5).ne(draws[0]).any()  # the seed counts


def test_a_worker_threads_error_reaches_the_caller(monkeypatch):
    """A chunk that fails on a worker thread (out of memory, say) fails the draw in the caller,
    with its own exception, after every thread has ended."""
    monkeypatch.setattr(init_mod, "CHUNK_ELEMENTS", 1000)
    real = init_mod.name_seed

    def failing(seed, name):
        if name.endswith("#1"):  # chunk 1: the second thread's share with two threads
            raise MemoryError("chunk 1")
        return real(seed, name)
    monkeypatch.setattr(init_mod, "name_seed", failing)
    with pytest.raises(MemoryError, match="chunk 1"):
        init_mod.normal(3, "embedding.weight", (70, 64), 0.5, threads=2)


def test_a_slice_over_several_ranks_is_marked_and_a_bad_split_names_the_parameter():
    """``param(..., shard_dim=)`` over more than one rank marks the slice as the TP layers mark
    theirs (the checkpoint then saves the logical tensor); one that does not split evenly is
    refused with the parameter's name."""
    half = Initializer(3).param("layers.0.scale", (4, 6), shard_dim=1, rank=1, size=2)
    assert half.shape == (4, 3) and (half.tp_sharded, half.tp_shard_dim) == (True, 1)
    assert not hasattr(Initializer(3).param("layers.0.scale", (4, 6), shard_dim=1), "tp_sharded")
    with pytest.raises(ValueError, match=r"parameter layers.0.bias_heads \(3,\): dimension 0 of "
                                         r"size 3 does not split over 2 ranks"):
        Initializer(3).param("layers.0.bias_heads", (3,), "zeros", shard_dim=0, rank=0, size=2)
