import json

import numpy as np
import pytest

from engine.data import sampler as sampler_module
from engine.data.sampler import BlendedSampler, GlobalBatchSampler


def reference_stream(num_samples, seed, length):
    """The sample stream the contract describes: epoch permutations seeded by (seed, epoch), concatenated."""
    epochs = -(-length // num_samples)
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(num_samples) for e in range(epochs)])
    return stream[:length].tolist()


@pytest.mark.parametrize("num_samples,gbs", [(10, 4), (37, 8), (3, 8), (16, 16)])
def test_global_batches_follow_seeded_epochs(num_samples, gbs):
    sampler = GlobalBatchSampler(num_samples, gbs, seed=7)
    steps = 9
    got = [i for step in range(steps) for i in sampler.global_batch(step)]
    assert got == reference_stream(num_samples, 7, steps * gbs)
    # Each epoch visits every sample exactly once.
    assert sorted(got[:num_samples]) == list(range(num_samples))


def test_global_batch_is_a_pure_function_of_seed_and_step():
    a = GlobalBatchSampler(100, 8, seed=3)
    b = GlobalBatchSampler(100, 8, seed=3)
    later_first = [b.global_batch(s) for s in (40, 3, 27, 0)]
    assert later_first == [a.global_batch(s) for s in (40, 3, 27, 0)]
    assert a.global_batch(5) == GlobalBatchSampler(100, 8, seed=3).global_batch(5)
    assert a.global_batch(5) != GlobalBatchSampler(100, 8, seed=4).global_batch(5)
    assert a.global_batch(5) != a.global_batch(6)


def test_every_layout_cuts_the_same_global_batch():
    sampler = GlobalBatchSampler(50, 16, seed=11)
    for step in (0, 3, 7):  # 50 samples / 16 per step: step 3 crosses an epoch boundary
        expected = sampler.global_batch(step)
        for dp, mb in [(1, 1), (1, 16), (2, 2), (2, 8), (4, 1), (4, 4), (8, 2), (16, 1)]:
            flat = []
            for rank in range(dp):
                micro = sampler.micro_batches(step, rank, dp, mb)
                assert len(micro) == 16 // (dp * mb)
                assert all(len(m) == mb for m in micro)
                flat += [i for m in micro for i in m]
            assert flat == expected, (dp, mb)


def test_micro_batch_errors_say_what_to_change():
    sampler = GlobalBatchSampler(50, 12, seed=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        sampler.micro_batches(0, 0, 2, 4)
    with pytest.raises(ValueError, match="dp_rank 2"):
        sampler.micro_batches(0, 2, 2, 2)
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchSampler(50, 12, seed=-1)
    with pytest.raises(ValueError, match="empty"):
        GlobalBatchSampler(0, 12, seed=0)


def test_state_dict_round_trip_resumes_the_same_stream():
    run = GlobalBatchSampler(40, 8, seed=5)
    run.next_step = 13
    state = json.loads(json.dumps(run.state_dict()))  # plain data: goes into a checkpoint without pickle
    assert state["next_step"] == 13 and state["seed"] == 5

    resumed = GlobalBatchSampler(40, 8, seed=5)
    resumed.load_state_dict(state)
    assert resumed.next_step == 13
    for step in range(13, 20):
        assert resumed.global_batch(step) == run.global_batch(step)

    # another --seed draws another train/validation split: the checkpoint's order would mix them
    with pytest.raises(ValueError, match="drawn with --seed 5 and this run has --seed 0.*--finetune"):
        GlobalBatchSampler(40, 8, seed=0).load_state_dict(state)

    with pytest.raises(ValueError, match="global-batch-size"):
        GlobalBatchSampler(40, 16, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples=40"):
        GlobalBatchSampler(41, 8, seed=5).load_state_dict(state)



def as_rank_batches_reads(sampler, steps, dp=2, mbs=1):
    """Each step's batch read as ``rank_batches`` reads it with --eod-mask-loss: the global batch
    (the loss count), then this rank's micro-batches."""
    return [(sampler.global_batch(step), sampler.micro_batches(step, dp - 1, dp, mbs)) for step in steps]


# batches straddling consecutive epochs (4 of 7 samples per step; the blend's members too)
PLAIN = lambda: GlobalBatchSampler(7, 4, seed=5)  # noqa: E731
BLEND = lambda: BlendedSampler([5, 3], [0.6, 0.4], 4, seed=5)  # noqa: E731


def test_epoch_orders_are_kept_in_int32_with_numpys_values():
    """The memo holds int32 (half of numpy's int64 permutation) with the same values, so every
    batch is what it was."""
    from engine.data import sampler as sampler_module
    order = sampler_module.epoch_order(1000, 5, (), 3)
    assert order.dtype == np.int32
    assert np.array_equal(order, np.random.default_rng([5, 3]).permutation(1000))


@pytest.mark.parametrize("make", [PLAIN, BLEND])
def test_each_epoch_permutation_is_built_once(monkeypatch, make):
    """Each step's batch read twice: every (member, epoch) permutation is built once, not again
    because the memo dropped the epoch still being read when the next one came in."""
    built = []
    real = sampler_module.epoch_order

    def counting(num_samples, seed, key, epoch):
        built.append((key, epoch))
        return real(num_samples, seed, key, epoch)

    monkeypatch.setattr(sampler_module, "epoch_order", counting)
    as_rank_batches_reads(make(), range(12))  # 48 samples: 6+ epochs of each stream
    assert len(built) > 6 and len(built) == len(set(built)), built


def test_the_memo_does_not_change_the_batches():
    """The batches of a fixed seed, as the sampler gave them before the memo became an LRU."""
    plain = as_rank_batches_reads(PLAIN(), range(6))
    assert [gb for gb, _ in plain] == [[1, 4, 2, 3], [6, 5, 0, 4], [2, 0, 6, 5], [3, 1, 0, 4],
                                       [5, 3, 1, 2], [6, 6, 1, 0]]
    assert [mine for _, mine in plain] == [[[2], [3]], [[0], [4]], [[6], [5]], [[0], [4]],
                                           [[1], [2]], [[1], [0]]]
    blend = as_rank_batches_reads(BLEND(), range(6))
    assert [gb for gb, _ in blend] == [[2, 6, 5, 4], [3, 0, 1, 7], [7, 3, 2, 5], [5, 6, 0, 4],
                                       [7, 1, 0, 2], [1, 6, 7, 3]]
    assert [mine for _, mine in blend] == [[[5], [4]], [[1], [7]], [[2], [5]], [[0], [4]],
                                           [[0], [2]], [[7], [3]]]
