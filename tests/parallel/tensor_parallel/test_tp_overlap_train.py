"""--tp-comm-overlap through the real trainer: every TP layout with sequence parallelism trains the
same model as the serial run over 20 steps (losses and grad norms to a relative 1e-4,
docs/design.md): tp=4; tp=2 x dp=2 with the llama block (SwiGLU: two column-parallel weights on one
ring); tp=2 x pp=2 under zb-v (the zero-bubble W actions take the deferred weight gradients); and
(tp, pp, dp) = (2, 2, 2). One spawned group per world size; the layouts and the serial reference are
test_equivalence_zb's (4 layers x 32 hidden, sequence 16, global batch 12). One short tp=2 x pp=2
zb-v run is repeated under the stream-order checker on every rank.
"""
from __future__ import annotations

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.runtime.stream_check import StreamChecker
from parallel.grid.topology import RankGrid
from tests.equivalence.test_equivalence_zb import assert_matches, layout, serial, train  # noqa: F401
from tests.helpers.dist_utils import run_distributed

OVERLAP = ("--sequence-parallel", "--tp-comm-overlap")
WORLD4 = [
    layout(1, "1f1b", 2, *OVERLAP, tp=4),
    layout(1, "1f1b", 3, *OVERLAP, "--block", "llama", tp=2, dp=2),
    layout(2, "zb-v", 3, *OVERLAP, tp=2),
]
WORLD8 = [layout(2, "1f1b", 3, *OVERLAP, tp=2, dp=2)]


def world4_group(ps) -> dict:
    out = {"layouts": [train(argv) for argv in WORLD4]}
    checker = StreamChecker()
    with checker.installed():
        out["checked"] = train(layout(2, "zb-v", 3, *OVERLAP, tp=2), steps=2)
    checker.check()
    return out


def overlapped_layers(argv: list[str]) -> int:
    """How many TP linear layers of this rank's chunks the trainer switched to the overlap."""
    from tests.equivalence.test_equivalence_zb import BASE
    trainer = Trainer(parse_args(BASE + ["--train-iters", "1"] + argv))
    try:
        return sum(getattr(m, "tp_comm_overlap", None) == "auto" for m in trainer.chunks.modules())
    finally:
        trainer.close()


def world8_group(ps) -> dict:
    return {"layouts": [train(argv) for argv in WORLD8], "overlapped": overlapped_layers(WORLD8[0])}


def _block(argv: list[str]) -> str:
    return "llama" if "llama" in argv else "gpt2"


def test_tp4_tp2_dp2_tp2_pp2_zbv_with_overlap_match_serial(serial):
    results = run_distributed(world4_group, grid=RankGrid(tp=4), timeout_s=300)
    for i, argv in enumerate(WORLD4):
        assert_matches(results[0]["layouts"][i], serial[_block(argv)], " ".join(argv))
    checked = results[0]["checked"]
    assert_matches(checked, {k: v[:2] for k, v in serial["gpt2"].items()}, "under the checker")


def test_tp2_pp2_dp2_with_overlap_matches_serial(serial):
    results = run_distributed(world8_group, grid=RankGrid(tp=2, pp=2, dp=2), timeout_s=300)
    for i, argv in enumerate(WORLD8):
        assert_matches(results[0]["layouts"][i], serial[_block(argv)], " ".join(argv))
    # 2 layers per stage, each with 4 TP linear layers (QKV, projection, fc1, fc2)
    assert all(r["overlapped"] == 2 * 4 for r in results), [r["overlapped"] for r in results]
