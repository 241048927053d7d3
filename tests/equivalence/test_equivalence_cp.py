"""Context parallelism through the real trainer, against the serial run: 20 steps, per-step losses
and grad norms within docs/design.md's relative 1e-4.

The models of test_equivalence_packed.py (both blocks, with and without packed documents, three
with grouped-query attention) spread over the layouts so that each CP size (2 and 4) and each
attention algorithm (ring p2p and Ulysses a2a; cp = 4 a2a repeats the two key/value heads) trains
both blocks packed and unpacked, as do (tp=2, cp=2) with sequence parallelism and (cp=2, pp=2,
dp=2) between them; ZeRO-1 sharded over CP alone and over DP x CP, selective and full
recomputation ride along. The serial run takes micro-batches of 8 sequences, the parallel ones two
micro-batches per rank (of 4 sequences without DP, of 2 with it): with --eod-mask-loss the
micro-batches and the sequence shards hold different numbers of unmasked tokens, so only the
global-batch normalisation matches.
"""
from __future__ import annotations

from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.equivalence.test_equivalence_packed import MODELS, assert_matches, serial, train_all  # noqa: F401

# layout: (its flags, the models it trains). Each layout trains a packed and an unpacked model, and
# cp = 2 and cp = 4 each train both blocks with and without packed documents.
LAYOUTS = {
    "cp=2 p2p zero": (["--cp", "2", "--use-distributed-optimizer"], ["gpt2 packed", "llama G=2"]),
    "cp=2 a2a selective": (["--cp", "2", "--cp-comm-type", "a2a", "--recompute", "selective"],
                           ["llama G=2 packed", "gpt2 G=2"]),
    "cp=4 p2p full": (["--cp", "4", "--recompute", "full"], ["llama G=2 packed", "gpt2"]),
    "cp=4 a2a": (["--cp", "4", "--cp-comm-type", "a2a"], ["gpt2 packed", "llama G=2"]),
    "tp=2 cp=2 sp": (["--tp", "2", "--cp", "2", "--sequence-parallel"], ["gpt2", "llama G=2 packed"]),
    "cp=2 pp=2 dp=2 zero": (["--cp", "2", "--pp", "2", "--dp", "2", "--use-distributed-optimizer"],
                            ["gpt2 packed", "llama G=2"]),
}


def jobs_for(layouts: list[str]) -> list[tuple[str, str, list[str]]]:
    """Each layout's runs, two micro-batches per rank (of the global batch's 8 sequences)."""
    return [(m, name, MODELS[m] + LAYOUTS[name][0] +
             ["--micro-batch-size", "2" if "--dp" in LAYOUTS[name][0] else "4"])
            for name in layouts for m in LAYOUTS[name][1]]


def test_every_model_meets_both_sizes_and_both_algorithms():
    """The table above keeps its promise: each CP size and each attention algorithm trains both
    blocks, packed and not, and each layout a packed and an unpacked model."""
    def models(names):
        return {m for n in names for m in LAYOUTS[n][1]}
    blocks = {"gpt2": {"gpt2", "gpt2 packed", "gpt2 G=2"}, "llama": {"llama G=2", "llama G=2 packed"}}
    for names in (["cp=2 p2p zero", "cp=2 a2a selective"], ["cp=4 p2p full", "cp=4 a2a"],
                  ["cp=2 p2p zero", "cp=4 p2p full"], ["cp=2 a2a selective", "cp=4 a2a"]):
        got = models(names)
        for block, kinds in blocks.items():
            assert any("packed" in m for m in got & kinds) and any("packed" not in m for m in got & kinds), (names, block)
    for name, (_, ms) in LAYOUTS.items():
        assert any("packed" in m for m in ms) and any("packed" not in m for m in ms), name


def test_two_rank_cp_matches_serial(serial):
    jobs = jobs_for(["cp=2 p2p zero", "cp=2 a2a selective"])
    assert_matches(run_distributed(train_all, grid=RankGrid(cp=2), args=(jobs,))[0], serial)


def test_four_rank_cp_matches_serial(serial):
    jobs = jobs_for(["cp=4 p2p full", "cp=4 a2a", "tp=2 cp=2 sp"])
    assert_matches(run_distributed(train_all, grid=RankGrid(cp=4), args=(jobs,))[0], serial)


def test_cp_pp_dp_matches_serial(serial):
    jobs = jobs_for(["cp=2 pp=2 dp=2 zero"])
    assert_matches(run_distributed(train_all, grid=RankGrid(cp=2, pp=2, dp=2), args=(jobs,))[0], serial)
