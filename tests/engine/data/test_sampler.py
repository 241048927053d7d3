import json

import numpy as np
import pytest

from engine.data.sampler import GlobalBatchSampler


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

    resumed = GlobalBatchSampler(40, 8, seed=0)
    resumed.load_state_dict(state)
    assert resumed.next_step == 13 and resumed.seed == 5
    for step in range(13, 20):
        assert resumed.global_batch(step) == run.global_batch(step)

    with pytest.raises(ValueError, match="global-batch-size"):
        GlobalBatchSampler(40, 16, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples=40"):
        GlobalBatchSampler(41, 8, seed=5).load_state_dict(state)
