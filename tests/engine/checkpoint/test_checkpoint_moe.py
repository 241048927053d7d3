"""Checkpoints of mixture-of-experts runs under expert parallelism, with aux-loss-free balancing
(the routers' expert biases are saved beside the parameters).

One group of 4 gloo ranks runs a chain of trainers (fp32, mock data, llama blocks with MoE every
layer, 4 experts, sigmoid scores and the expert bias, per-sequence aux loss):
  A  dp 4, ep 2: 7 steps, saving at steps 3, 6 and 7                      -> reference
  E  the same layout, loaded from A's step 3: bit-identical steps 4-6
  B  tp 2 (dp 2), ep 2, loaded from A's step 3 (expert weights stay whole, the dense ones split)
  C  dp 4, ep 4, loaded from A's step 3 (each rank one expert): steps 4-5, saving at step 5
  D  pp 2 (dp 2), ep 1, loaded from C's step 5: steps 6-7
and a serial run (ep 1) in this process loads A's step 3 (steps 4-6), as does engine.generate's
``load_model`` (its routers' biases are the saved ones). Every expert is written once, by
expert-data-parallel rank 0 of its EP group, under its global index; the biases once. Every
layer's bias, over all ranks (each pipeline stage holds its own layers), is the saved one once
loaded and moves on as A's did. (Both layers' biases come back to zero after steps 2 and 4 of
this run, so D loads step 5's, where the two layers' differ: the test checks that they do.)
"""
import json
import os

import pytest
import torch
from safetensors import safe_open

from engine.checkpoint import CheckpointError
from engine.config.cli import parse_args
from engine.tools.generate import load_model
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


def _biases(trainer) -> dict[str, torch.Tensor]:
    """This rank's routers' expert biases, by global layer name (``layers.<i>.mlp.router...``)."""
    return {f"layers.{index}.{name}": buf.clone() for c in trainer.chunks
            for index, layer in zip(c.layer_range, c.layers)
            for name, buf in layer.named_buffers() if name.endswith("expert_bias")}


def _run(argv: list[str]) -> dict:
    """The losses and this rank's biases: as the first step found them (loaded), after each step
    and at the end."""
    trainer = Trainer(parse_args(BASE + argv))
    by_step, loaded, one = [], [], trainer.train_one

    def train_one(step: int) -> dict:
        if not loaded:
            loaded.append(_biases(trainer))
        record = one(step)
        by_step.append(_biases(trainer))
        return record

    trainer.train_one = train_one
    try:
        records = trainer.train().records
        return {"loss": [r["loss"] for r in records], "bias": _biases(trainer), "by_step": by_step,
                "loaded": loaded[0]}
    finally:
        trainer.close()


def merged(results: list[dict], run: str, key: str = "bias", step: int | None = None) -> dict:
    """A run's biases over all ranks (each rank's non-empty; ranks holding a layer agree):
    ``key`` "bias" at the end, "loaded", or "by_step" after 0-based ``step``."""
    out = {}
    for rank, r in enumerate(results):
        mine = r[run][key] if step is None else r[run][key][step]
        assert mine, (run, rank)
        for name, bias in mine.items():
            assert name not in out or torch.equal(out[name], bias), (run, rank, name)
            out[name] = bias
    return out


def chain(ps, root):
    a, c = os.path.join(root, "a"), os.path.join(root, "c")
    ck3 = os.path.join(a, "iter_0000003")
    return {"A": _run(["--dp", "4", "--ep", "2", "--save", a, "--save-interval", "3",
                       "--train-iters", "7", "--keep-last", "3"]),
            "E": _run(["--dp", "4", "--ep", "2", "--load", ck3]),
            "B": _run(["--tp", "2", "--dp", "2", "--ep", "2", "--load", ck3]),
            "C": _run(["--dp", "4", "--ep", "4", "--load", ck3, "--save", c, "--train-iters", "5"]),
            "D": _run(["--pp", "2", "--dp", "2", "--load", os.path.join(c, "iter_0000005"),
                       "--train-iters", "7"])}


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    results = run_distributed(chain, grid=RankGrid(dp=4), args=(root,), timeout_s=120)
    return root, results


def test_resume_under_ep_is_exact_and_reshards(chained):
    root, results = chained
    r = results[0]
    assert r["E"]["loss"] == r["A"]["loss"][3:6]                 # same layout: bit-identical
    close(r["B"]["loss"], r["A"]["loss"][3:6])
    close(r["C"]["loss"], r["A"]["loss"][3:5])
    close(r["D"]["loss"], r["A"]["loss"][5:])
    # the biases of every layer, over all ranks (D's pipeline stages hold one layer each): the
    # saved ones once loaded, then moving on as A's (E's bit for bit)
    names = [f"layers.{i}.mlp.router.expert_bias" for i in range(2)]
    assert sorted(merged(results, "A")) == names, sorted(merged(results, "A"))
    assert len(r["A"]["by_step"]) == 7       # (after a step: its update's biases)

    def after(step: int) -> dict:
        return merged(results, "A", "by_step", step - 1)
    assert all(torch.equal(after(7)[n], merged(results, "A")[n]) for n in names)
    assert not torch.equal(*(after(5)[n] for n in names))   # D's load can tell its layers apart
    for run, start, end in (("E", 3, 6), ("B", 3, 6), ("C", 3, 5), ("D", 5, 7)):
        exact = torch.equal if run == "E" else (lambda x, y: torch.allclose(x, y, atol=1e-6))
        for key, ref in (("loaded", after(start)), ("bias", after(end))):
            got = merged(results, run, key)
            assert sorted(got) == names, (run, key, sorted(got))
            for name in names:
                assert exact(got[name], ref[name]), (run, key, name, got[name], ref[name])
    serial = _run(["--load", os.path.join(root, "a", "iter_0000003")])
    close(serial["loss"], r["A"]["loss"][3:6])
    for key, ref in (("loaded", after(3)), ("bias", after(6))):
        assert sorted(serial[key]) == names, (key, sorted(serial[key]))
        assert all(torch.allclose(serial[key][n], ref[n], atol=1e-6) for n in names), (key, serial[key])
    # a resume that leaves the expert bias out would drop the trained biases: refused
    i = BASE.index("--moe-router-bias-update-rate")
    argv = [a for a in BASE[:i] + BASE[i + 2:] if a != "--moe-router-enable-expert-bias"]
    trainer = Trainer(parse_args(argv + ["--load", os.path.join(root, "a", "iter_0000003")]))
    try:
        with pytest.raises(CheckpointError, match="saved with --moe-router-enable-expert-bias True"):
            trainer.maybe_load()
    finally:
        trainer.close()
    # engine.generate's model routes as trained: the biases too (they were left at zero)
    model, _, _ = load_model(os.path.join(root, "a", "iter_0000003"))
    got = {f"layers.{i}.{n}": b for i, layer in enumerate(model.layers)
           for n, b in layer.named_buffers() if n.endswith("expert_bias")}
    assert sorted(got) == names and all(torch.equal(got[n], after(3)[n]) for n in names), got


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
