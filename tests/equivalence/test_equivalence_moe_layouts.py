"""Mixture-of-experts layers under sequence and context parallelism and the zero-bubble and
interleaved pipeline schedules, through the real trainer, against the serial trainer.

fp32, dropless routing, one seed, mock data: every layout trains the serial model on the same
samples, so the per-step token loss, the balancing losses as trained (``moe_aux_loss``,
``moe_z_loss``) and the gradient norm must agree with the serial run to a relative 1e-4, and the
per-expert load of every step exactly (every token counted once):

- ep 2 with tp 2 and sequence parallelism (dp 2): each TP rank routes its own sequence shard, the
  router's and experts' gradients are summed over TP; gpt2 blocks with the global aux loss (one
  micro-batch per rank: the micro-step is the global batch), the z-loss and a shared expert, and
  llama blocks with the per-sequence aux loss (2 micro-batches per rank, 4 serially);
- ep 2 drawn from the CP ranks (tp 2, cp 2, dp 1), with the global aux loss and full
  recomputation (the MoE layers rerun in the backward, dispatch included); and the same grid
  with sequence parallelism too and the per-sequence aux loss (each sequence split over TP and CP);
- pp 2 (dp 2, ep 2) under zb-h1, zb-v and the interleaved schedule (2 virtual stages, selective
  recomputation), every layer an MoE layer, so every model chunk of both stages holds one; the
  zero-bubble schedules run the router's and experts' weight gradients in their W actions (the
  stacked experts' ``_GroupedLinearDeferW``, against the serial run with ``--no-moe-grouped-gemm``,
  the loop over the same weights): under zb-v and zb-h1 rank 0 counts the grouped W closures it
  ran, one per projection (fc1, fc2) of each of its 2 MoE layers per micro-batch (4) and step, so
  none was computed in B.

One spawned group of 4 ranks runs every layout in sequence; the serial runs go first, in this
process. In one process: under a capturing ``WeightGradStore`` (the B/W split of the zero-bubble
schedules) the router's and experts' weight gradients wait for W, and W gives the plain backward's,
with looped and with grouped-GEMM experts.
"""
from __future__ import annotations

import pytest
import torch

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from models import LayerContext, build_chunks
from models.config import GPTConfig
from models.moe import grouped_split
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from parallel.grads.weight_grad import WeightGradStore, attach_weight_grad_store
from tests.helpers.dist_utils import run_distributed

STEPS, REL, GLOBAL_BATCH, SEQ = 20, 1e-4, 8, 16
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(STEPS), "--precision", "fp32",
        "--lr", "1e-2", "--lr-warmup-iters", "0", "--peak-tflops", "1", "--timeout-s", "120",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.05",
        "--moe-z-loss-coeff", "1e-3"]
# the global aux loss (one micro-batch per rank and step), z-loss, a shared expert
GPT2 = ["--block", "gpt2", "--num-layers", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-shared-expert-intermediate-size", "16"]
# the per-sequence aux loss, sigmoid scores, MoE every second layer
LLAMA = ["--block", "llama", "--num-layers", "2", "--moe-layer-freq", "[0,1]",
         "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-score-function", "sigmoid",
         "--moe-ffn-hidden-size", "24"]
# four MoE layers: one in each model chunk of both stages under zb-v and 2 virtual stages
# (the serial reference loops over the experts; the layouts run them grouped)
PIPE = ["--block", "gpt2", "--num-layers", "4", "--moe-router-load-balancing-type", "seq_aux_loss",
        "--no-moe-grouped-gemm"]
SP = ["--sequence-parallel"]


def mbs(n: int) -> list[str]:
    return ["--micro-batch-size", str(n)]


# (name, model flags, serial micro-batch size, layout flags)
LAYOUTS = [
    ("tp2 sp dp2 ep2 aux_loss", GPT2, 8, ["--tp", "2", "--dp", "2", "--ep", "2", *SP, *mbs(4)]),
    ("tp2 sp dp2 ep2 seq_aux_loss", LLAMA, 2, ["--tp", "2", "--dp", "2", "--ep", "2", *SP, *mbs(2)]),
    ("tp2 cp2 ep2 aux_loss, full recompute", GPT2, 8, ["--tp", "2", "--cp", "2", "--ep", "2",
                                                       *mbs(8), "--recompute", "full"]),
    ("tp2 sp cp2 ep2 seq_aux_loss", LLAMA, 2, ["--tp", "2", "--cp", "2", "--ep", "2", *SP, *mbs(4)]),
    ("pp2 zb-v dp2 ep2 grouped gemm", PIPE, 2, ["--pp", "2", "--dp", "2", "--ep", "2", *mbs(1),
                                                "--pipeline-schedule", "zb-v",
                                                "--moe-grouped-gemm"]),
    ("pp2 zb-h1 dp2 ep2", PIPE, 2, ["--pp", "2", "--dp", "2", "--ep", "2", *mbs(1),
                                    "--pipeline-schedule", "zb-h1", "--moe-grouped-gemm"]),
    ("pp2 interleaved dp2 ep2, selective recompute", PIPE, 2,
     ["--pp", "2", "--dp", "2", "--ep", "2", *mbs(1), "--pipeline-schedule", "interleaved",
      "--virtual-pipeline-size", "2", "--recompute", "selective", "--moe-grouped-gemm"]),
]
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_expert_load")


# the grouped experts' W closures rank 0 ran under zb-v and zb-h1: 20 steps x 4 micro-batches x 2
# MoE layers (zb-v: one per model chunk) x 2 projections
GROUPED_W = STEPS * (GLOBAL_BATCH // 2) * 2 * 2


def _train(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    ran: list = []
    real = grouped_split._weight_grads  # what a grouped projection's W closure calls
    grouped_split._weight_grads = lambda *a: ran.append(1) or real(*a)
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    try:
        records = trainer.train().records
        ep = trainer.ps.ep_group.size
    finally:
        trainer.close()
        grouped_split._weight_grads = real
    return {**{k: [r[k] for r in records] for k in KEYS}, "ep": ep, "grouped_w": len(ran)}


def _layouts(ps, layouts: list) -> list[dict]:
    return [_train(model + flags) for _, model, _, flags in layouts]


def _check(name: str, got: dict, ref: dict) -> None:
    assert got["ep"] == 2, name
    assert len(got["loss"]) == len(ref["loss"]) == STEPS, name
    for key in KEYS[:4]:
        for step, (x, want) in enumerate(zip(got[key], ref[key]), start=1):
            assert abs(x - want) <= REL * abs(want), f"{name}: {key} at step {step} is {x}, serial {want}"
    assert all(v > 0 for v in ref["moe_aux_loss"] + ref["moe_z_loss"])
    for step, (x, want) in enumerate(zip(got["moe_expert_load"], ref["moe_expert_load"]), start=1):
        assert x == want, f"{name}: expert load at step {step} is {x}, serial {want}"


def test_moe_sp_cp_and_pipeline_schedules_equal_serial():
    serial: dict = {}
    for _, model, serial_mbs, _ in LAYOUTS:
        key = (tuple(model), serial_mbs)
        if key not in serial:
            serial[key] = _train(model + mbs(serial_mbs), launch=LaunchEnv())
    runs = run_distributed(_layouts, grid=RankGrid(dp=4), args=(LAYOUTS,))
    for i, (name, model, serial_mbs, flags) in enumerate(LAYOUTS):
        for rank_runs in runs:   # every rank's records: the step's figures are global
            _check(name, rank_runs[i], serial[(tuple(model), serial_mbs)])
        assert runs[0][i]["grouped_w"] == (GROUPED_W if "zb" in name else 0), name


@pytest.mark.parametrize("grouped", [False, True], ids=["looped", "grouped"])
def test_moe_weight_gradients_wait_for_w(grouped):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                    vocab_size=64, seed=7, block="llama", num_experts=4, moe_router_topk=2,
                    moe_aux_loss_coeff=0.05, moe_z_loss_coeff=1e-3,
                    moe_shared_expert_intermediate_size=16, moe_grouped_gemm=grouped)

    def model():
        return build_chunks(cfg, ParallelState.serial(), LayerContext(Initializer(7, cfg.init_std)),
                            [range(cfg.num_layers)], [0], 1)[0]

    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    plain = model()
    plain(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    split, store = model(), WeightGradStore()
    attach_weight_grad_store(split, store)
    with store.capture("b"):
        split(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    moe = [n for n, _ in split.named_parameters() if ".router." in n or ".experts." in n]
    assert len(moe) == 2 * (1 + 2)  # the router and the experts' gate-up and fc2 per layer
    params = dict(split.named_parameters())
    assert all(params[n].grad is None for n in moe), "B computed a router or expert weight gradient"
    assert store.run("b") > 0
    reference = dict(plain.named_parameters())
    for n in moe:
        assert reference[n].grad.abs().sum() > 0, n
        torch.testing.assert_close(params[n].grad, reference[n].grad, msg=n)
