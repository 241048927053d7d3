"""Checkpoints of mixture-of-experts runs under expert parallelism, with aux-loss-free balancing
(the routers' expert biases are saved beside the parameters).

One group of 4 gloo ranks runs a chain of trainers (fp32, mock data, llama blocks with MoE every
layer, 4 experts, sigmoid scores and the expert bias, per-sequence aux loss):
  A  dp 4, ep 2: 6 steps, saving at steps 3 and 6                          -> reference
  E  the same layout, loaded from A's step 3: bit-identical steps 4-6
  B  tp 2 (dp 2), ep 2, loaded from A's step 3 (expert weights stay whole, the dense ones split)
  C  dp 4, ep 4, loaded from A's step 3 (each rank one expert), saving at step 4
  D  pp 2 (dp 2), ep 1, loaded from C's step 4
and a serial run (ep 1) in this process loads A's step 3. Every expert is written once, by
expert-data-parallel rank 0 of its EP group, under its global index; the biases once.
"""
import json
import os

import pytest
import torch
from safetensors import safe_open

from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.engine.checkpoint.test_checkpoint_reshard import close
from tests.helpers.dist_utils import run_distributed

BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--precision", "fp32", "--lr", "2e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "constant", "--train-iters", "6",
        "--timeout-s", "60", "--block", "llama", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "24", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"]


def _run(argv: list[str]) -> dict:
    trainer = Trainer(parse_args(BASE + argv))
    try:
        records = trainer.train().records
        bias = [m.expert_bias.clone() for c in trainer.chunks for m in c.modules()
                if getattr(m, "expert_bias", None) is not None]
        return {"loss": [r["loss"] for r in records], "bias": bias}
    finally:
        trainer.close()


def chain(ps, root):
    a, c = os.path.join(root, "a"), os.path.join(root, "c")
    ck3 = os.path.join(a, "iter_0000003")
    return {"A": _run(["--dp", "4", "--ep", "2", "--save", a, "--save-interval", "3"]),
            "E": _run(["--dp", "4", "--ep", "2", "--load", ck3]),
            "B": _run(["--tp", "2", "--dp", "2", "--ep", "2", "--load", ck3]),
            "C": _run(["--dp", "4", "--ep", "4", "--load", ck3, "--save", c, "--train-iters", "4"]),
            "D": _run(["--pp", "2", "--dp", "2", "--load", os.path.join(c, "iter_0000004")])}


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    results = run_distributed(chain, grid=RankGrid(dp=4), args=(root,), timeout_s=120)
    return root, results


def test_resume_under_ep_is_exact_and_reshards(chained):
    root, results = chained
    r = results[0]
    assert r["E"]["loss"] == r["A"]["loss"][3:]                  # same layout: bit-identical
    assert all(torch.equal(x, y) for x, y in zip(r["E"]["bias"], r["A"]["bias"]))
    close(r["B"]["loss"], r["A"]["loss"][3:])
    close(r["C"]["loss"], r["A"]["loss"][3:4])
    close(r["D"]["loss"], r["A"]["loss"][4:])
    for got in (r["B"], r["D"]):  # the biases went on moving from the saved ones
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(got["bias"], r["A"]["bias"]))
    serial = _run(["--load", os.path.join(root, "a", "iter_0000003")])
    close(serial["loss"], r["A"]["loss"][3:])


def test_every_expert_and_bias_is_written_once(chained):
    root, _ = chained
    ckpt = os.path.join(root, "a", "iter_0000003")
    with open(os.path.join(ckpt, "index.json")) as fh:
        index = json.load(fh)
    tensors = index["tensors"]
    for layer in range(2):
        for e in range(4):
            for part in ("gate", "up", "fc2"):
                entry = tensors[f"model/layers.{layer}.mlp.experts.experts.{e}.{part}.weight"]
                assert len(entry["pieces"]) == 1, (layer, e, part)
                # ep 2 over dp 4: EP groups [0, 1] and [2, 3], experts 0-1 on ranks 0 and 2,
                # 2-3 on ranks 1 and 3; the first EP group (EDP rank 0) writes them
                assert entry["pieces"][0]["file"] == f"rank_{e // 2:05d}.safetensors"
            assert f"optim/exp_avg/layers.{layer}.mlp.experts.experts.{e}.gate.weight" in tensors
        bias = tensors[f"model/layers.{layer}.mlp.router.expert_bias"]
        assert bias["shape"] == [4] and len(bias["pieces"]) == 1
        with safe_open(os.path.join(ckpt, bias["pieces"][0]["file"]), framework="pt") as fh:
            saved = fh.get_tensor(bias["pieces"][0]["key"])
        assert saved.abs().sum() > 0  # it moved during the first 3 steps
