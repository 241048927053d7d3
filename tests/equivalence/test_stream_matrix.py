"""The stream-order checker over every block kind and every path that uses a second stream, a
worker thread or a communicator beside the compute stream, through the real trainer.

Block kinds: gpt2, llama, MoE on gpt2 blocks with the alltoall dispatcher, MoE on llama blocks with
the allgather dispatcher, and a user's block (examples/parallel_block.py). Paths: ZeRO-1/2 with
the overlapped parameter gather (buckets of 1 KiB), compression on the exchange side stream (int8
and top-k after a one-step warm-up), the CP ring (p2p), the TP overlap's chunked ring (sequence
parallel), asynchronous checkpoint copies (a save every step) and the transfers of every pipeline
schedule (gpipe, 1f1b, interleaved, 1f1b-w, zb-h1, zb-v). Each run combines several paths on 4
gloo ranks so that every block kind meets every path and every schedule is run (the table below),
2 steps each, in one pool of 4 rank processes (engine/fuzz/pool.py):

- no rank's checker records a violation, and every two ranks submit to the communicators they
  share in the same order (parallel/runtime/lanes.py ``order_mismatch``);
- the uncompressed runs also train the serial model (per-step loss and gradient norm to a
  relative 1e-4, engine/fuzz/compare.py); compressed runs change the gradients by design, and the
  FP8 run (bf16 with FP8 GEMMs: its amax all-reduces over CP and, for the experts under EP with CP,
  over EDP, beside ZeRO-1's gathers) computes in other precisions.
"""
from __future__ import annotations

import pytest

from engine.fuzz.compare import judge
from engine.fuzz.pool import Pool
from engine.fuzz.space import Case
from engine.fuzz.cli import serial_quietly
from parallel.runtime.lanes import order_mismatch

STEPS = 2
MOE_A2A = dict(block="gpt2", moe=True, dispatcher="alltoall")
MOE_AG = dict(block="llama", moe=True, dispatcher="allgather")
TP_RING = dict(tp=2, sp=True, tp_overlap=True)
CP_RING = dict(cp=2, cp_comm="p2p")
INT8 = ["--grad-compression", "int8", "--grad-compression-warmup-steps", "1"]
TOPK = ["--grad-compression", "topk", "--grad-compression-ratio", "0.1",
        "--grad-compression-warmup-steps", "1"]
ASYNC = ["--async-save", "--save-interval", "1"]     # --save is added per run
# FP8's amax all-reduces (TP, CP, and the experts' over EDP under EP with CP) on the compute
# stream, beside ZeRO's gathers on the same groups; bf16, so not compared with the fp32 serial run
FP8 = ["--precision", "bf16", "--fp8-format", "hybrid"]


def zero(stage: int) -> dict:
    return dict(zero=stage, overlap_gather=True, bucket_kb=1)


# name: (case, extra flags); the paths each covers in the comment
RUNS = {
    "gpt2 tp-ring gpipe async": (Case(**TP_RING, pp=2, schedule="gpipe"), ASYNC),
    "gpt2 cp-ring zero2": (Case(**CP_RING, dp=2, **zero(2)), []),
    "gpt2 int8 1f1b": (Case(dp=2, pp=2, schedule="1f1b"), INT8),
    "llama tp-ring interleaved": (Case(block="llama", **TP_RING, pp=2, schedule="interleaved",
                                       vp=2, layers=4), []),
    "llama cp-ring topk async": (Case(block="llama", **CP_RING, dp=2), TOPK + ASYNC),
    "llama zero1 zb-h1": (Case(block="llama", dp=2, pp=2, schedule="zb-h1", **zero(1)), []),
    "moe-a2a tp-ring zero1 async": (Case(**MOE_A2A, **TP_RING, dp=2, ep=2, **zero(1)), ASYNC),
    "moe-a2a cp-ring zb-v": (Case(**MOE_A2A, **CP_RING, pp=2, schedule="zb-v", layers=4, ep=2), []),
    "moe-a2a int8 edp2": (Case(**MOE_A2A, dp=4, ep=2), INT8),
    "moe-ag tp-ring 1f1b-w": (Case(**MOE_AG, **TP_RING, etp=2, pp=2, schedule="1f1b-w"), []),
    "moe-ag cp-ring zero2 async": (Case(**MOE_AG, **CP_RING, dp=2, ep=2, **zero(2)), ASYNC),
    "moe-ag cp-ring zero1 fp8": (Case(**MOE_AG, **CP_RING, dp=2, ep=2, **zero(1)), FP8),
    "moe-ag topk 1f1b": (Case(**MOE_AG, dp=2, pp=2, ep=2), TOPK),
    "user tp-ring zero1": (Case(block="user", **TP_RING, dp=2, **zero(1)), []),
    "user cp-ring zb-v": (Case(block="user", **CP_RING, pp=2, schedule="zb-v", layers=4), []),
    "user int8 async": (Case(block="user", dp=4), INT8 + ASYNC),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_matrix")
    pool, out = Pool(4), {}
    try:
        for i, (name, (case, extra)) in enumerate(RUNS.items()):
            assert case.world == 4, name
            if "--async-save" in extra:
                extra = extra + ["--save", str(root / f"run{i}")]
            out[name] = pool.run(i, case.argv(STEPS) + extra, 240.0)
            assert not pool.broken, (name, out[name])
    finally:
        pool.close()
    return out


def test_every_block_meets_every_path_and_every_schedule_runs():
    kinds = {"gpt2": set(), "llama": set(), "moe-a2a": set(), "moe-ag": set(), "user": set()}
    schedules = set()
    for name, (case, extra) in RUNS.items():
        paths = kinds[name.split()[0]]
        paths |= {"tp-ring"} if case.tp_overlap else set()
        paths |= {"cp-ring"} if case.cp > 1 and case.cp_comm == "p2p" else set()
        paths |= {"zero"} if case.overlap_gather else set()
        paths |= {"compression"} if "--grad-compression" in extra else set()
        paths |= {"async"} if "--async-save" in extra else set()
        if case.pp > 1:
            paths.add("pipeline")
            schedules.add(case.schedule)
    assert all(p == {"tp-ring", "cp-ring", "zero", "compression", "async", "pipeline"}
               for p in kinds.values()), kinds
    assert schedules == {"gpipe", "1f1b", "interleaved", "1f1b-w", "zb-h1", "zb-v"}


@pytest.mark.parametrize("name", list(RUNS))
def test_no_violation_and_one_submission_order(results, name):
    ranks = results[name]
    for rank, out in enumerate(ranks):
        assert "error" not in out, out.get("error")
        assert out["violations"] == [], (rank, out["violations"])
    assert order_mismatch({r: out["order"] for r, out in enumerate(ranks)}) is None


@pytest.mark.parametrize("name", [n for n, (_, extra) in RUNS.items()
                                  if "--grad-compression" not in extra and "--fp8-format" not in extra])
def test_uncompressed_runs_train_the_serial_model(results, name):
    case, _ = RUNS[name]
    verdict = judge(results[name], serial_quietly(case, STEPS))
    assert verdict.ok, verdict.why
