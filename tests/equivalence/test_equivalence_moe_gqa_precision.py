"""Mixture-of-experts layers with grouped-query attention, and in fp16 and bf16, through the real
trainer against the serial trainer.

- llama blocks with grouped-query attention (8 query heads, 2 key/value groups) and MoE MLPs,
  fp32, dropless routing, one seed: ep 2 with dp 4 (ZeRO-1 on), and ep 2 with tp 2 (the two
  key/value groups split over TP, sequence parallelism on) give the serial run's per-step token
  loss, balancing losses and gradient norm to a relative 1e-4 over 20 steps, and its per-expert
  load exactly. The global aux loss is taken over each micro-step's tokens (one micro-batch per
  rank here, so the whole global batch): the serial run takes the global batch in one micro-batch.
- bf16, ep 2 with dp 4: the losses follow the serial bf16 run to a relative 2e-3 (the layouts
  round in a different order; docs/design.md's 1e-4 is for fp32; the gradient norms differ by up to
  2% in bf16, so only the losses are compared, as the zero-bubble schedules' bf16 test does).
- fp16 with the dynamic loss scaler, from an initial scale of 2**24, far above what the gradients
  take, so the first steps overflow and are skipped: ep 2 with dp 4 against ep 1 with dp 4. Where
  an overflow first happens depends on the data-parallel size (each rank's backward runs on the
  mean of its own micro-batch: a gradient dp times the serial one's, so dp 4 skips two more steps
  than the serial run), not on the expert layout: every step skips or steps exactly as the ep 1
  run, with the same loss scale, and the losses follow it to a relative 2e-3.
- A skipped step must be skipped on every rank, expert ranks included, or the replicas would
  part: after each dp 4 run, every parameter held by two or more ranks is bit-identical on them.

One spawned group of 4 ranks runs every layout in sequence; the serial runs go first, in this
process.
"""
from __future__ import annotations

import torch

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.launch import LaunchEnv
from models.logical import logical_views
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS, PREC_STEPS, REL, PREC_REL = 20, 10, 1e-4, 2e-3
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
        "--block", "llama", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
        "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "0", "--peak-tflops", "1",
        "--timeout-s", "120", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "0.05", "--moe-z-loss-coeff", "1e-3"]
GQA = ["--num-attention-heads", "8", "--num-query-groups", "2", "--precision", "fp32",
       "--train-iters", str(STEPS)]
HALF = ["--num-attention-heads", "4", "--train-iters", str(PREC_STEPS)]
FP16 = HALF + ["--precision", "fp16", "--initial-loss-scale", str(2 ** 24)]
BF16 = HALF + ["--precision", "bf16"]
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_expert_load", "loss_scale",
        "skipped")


def mbs(n: int) -> list[str]:
    return ["--micro-batch-size", str(n)]


# (name, model flags, serial micro-batch size, layout flags)
LAYOUTS = [
    ("gqa dp4 ep2 zero-1", GQA, 8, ["--dp", "4", "--ep", "2", *mbs(2),
                                    "--use-distributed-optimizer"]),
    ("gqa tp2 sp dp2 ep2", GQA, 8, ["--tp", "2", "--dp", "2", "--ep", "2", "--sequence-parallel",
                                    *mbs(4)]),
    ("fp16 dp4 ep1", FP16, None, ["--dp", "4", *mbs(2)]),   # the fp16 reference
    ("fp16 dp4 ep2", FP16, None, ["--dp", "4", "--ep", "2", *mbs(2)]),
    ("bf16 dp4 ep2", BF16, 8, ["--dp", "4", "--ep", "2", *mbs(2)]),
]


def _train(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    try:
        records = trainer.train().records
        ep = trainer.ps.ep_group.size
        # this rank's parameters, fp32, to compare the replicas after the run
        params = {n: p.detach().float().clone() for c in trainer.chunks
                  for n, p in logical_views(c).items()}  # each expert's own tensors
    finally:
        trainer.close()
    return {**{k: [r[k] for r in records] for k in KEYS}, "ep": ep, "params": params}


def _layouts(ps, layouts: list) -> list[dict]:
    return [_train(model + flags) for _, model, _, flags in layouts]


def _check(name: str, got: dict, ref: dict, rel: float, steps: int) -> None:
    assert len(got["loss"]) == len(ref["loss"]) == steps, name
    assert got["skipped"] == ref["skipped"], f"{name}: skipped steps {got['skipped']}, serial {ref['skipped']}"
    assert got["loss_scale"] == ref["loss_scale"], name
    # in half precision the gradient norm, a sum of squares of rounded values, wanders further
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss") if rel == REL else ("loss",):
        for step, (x, want) in enumerate(zip(got[key], ref[key]), start=1):
            if want is None:                                   # a skipped step has no norm
                assert x is None, f"{name}: {key} at step {step} is {x}, serial skipped it"
                continue
            assert abs(x - want) <= rel * abs(want), f"{name}: {key} at step {step} is {x}, serial {want}"
    if rel == REL:  # fp32: every token routed as serially
        for step, (x, want) in enumerate(zip(got["moe_expert_load"], ref["moe_expert_load"]), 1):
            assert x == want, f"{name}: expert load at step {step} is {x}, serial {want}"


def test_moe_gqa_fp16_bf16_equal_serial():
    serial: dict = {}
    for _, model, serial_mbs, _ in LAYOUTS:
        key = (tuple(model), serial_mbs)
        if serial_mbs is not None and key not in serial:
            serial[key] = _train(model + mbs(serial_mbs), launch=LaunchEnv())
    runs = run_distributed(_layouts, grid=RankGrid(dp=4), args=(LAYOUTS,), timeout_s=300)
    names = [name for name, *_ in LAYOUTS]
    fp16_ref = runs[0][names.index("fp16 dp4 ep1")]
    assert fp16_ref["skipped"][0] and not all(fp16_ref["skipped"]), fp16_ref["skipped"]  # overflowed
    assert fp16_ref["loss_scale"][0] == 2 ** 24 and fp16_ref["loss_scale"][-1] < 2 ** 24
    for i, (name, model, serial_mbs, flags) in enumerate(LAYOUTS):
        rel, steps = (REL, STEPS) if model is GQA else (PREC_REL, PREC_STEPS)
        if name == "fp16 dp4 ep2":
            _check(name, runs[0][i], fp16_ref, rel, steps)
        elif serial_mbs is not None:
            _check(name, runs[0][i], serial[(tuple(model), serial_mbs)], rel, steps)
        assert runs[0][i]["ep"] == (1 if name == "fp16 dp4 ep1" else 2), name
        if "--tp" in flags or name == "fp16 dp4 ep1":
            continue
        # dp 4, ep 2: two ranks hold experts 0-1, the other two experts 2-3, all the dense part;
        # every parameter held twice or more is bit-identical on its holders
        held = [runs[r][i]["params"] for r in range(4)]
        experts = [frozenset(n for n in h if ".experts." in n) for h in held]
        a, b = set(experts)                                   # two disjoint halves
        assert not a & b and len(a) == len(b) > 0, name
        for rank in (1, 2, 3):
            for n, p in held[rank].items():
                if n in held[0]:
                    torch.testing.assert_close(p, held[0][n], rtol=0, atol=0,
                                               msg=lambda m: f"{name}: {n} on rank {rank}: {m}")
                else:
                    assert ".experts." in n, (name, n, rank)
