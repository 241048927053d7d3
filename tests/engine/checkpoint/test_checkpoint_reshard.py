"""A checkpoint saved under one layout resumes under others with the uninterrupted run's losses.

One group of 8 gloo ranks runs a chain of trainers (spawning is the expensive part):
  A  (tp2, pp2, dp2) ZeRO-1, sequence parallel: 6 steps, saving at steps 3 and 6   -> reference
  E  the same layout, loaded from A's step 3: bit-identical steps 4-6
  C  (tp4, pp1, dp2) ZeRO off, loaded from A's step 3 (flat ZeRO ranges -> TP boxes): step 4, saved
  D  (tp1, pp4, dp2) ZeRO-1, loaded from C's step 4 (TP boxes -> flat ranges)
  F  (tp2, pp2, dp2) interleaved with 2 virtual stages, ZeRO off, loaded from A's step 3
  G  (tp2, pp2, dp2) ZeRO-2, loaded from A's step 3 (ZeRO-1): bit-identical steps 4-6, saved at 4
  H  (tp2, pp1, dp4) ZeRO off, loaded from G's step 4 (ZeRO-2 ranges -> dp 4 boxes)
and a serial run (tp=pp=dp=1, ZeRO off) in this process loads A's step 3.
The vocabulary (300) pads differently at tp 1, 2 and 4, so padding rows are dropped and restored.
The learning rate is constant after warmup, so a run that stops early (C) keeps the schedule.
Each resharding load (C, D, F, H) is also saved at once, before training, under ``resaved/``:
every model and optimizer logical tensor it holds is the one it loaded, element for element (a
resumed step's loss cannot see the optimizer state, and a later one only its sum over tensors).
"""
import json
import math
import os

import pytest
import torch

from engine.checkpoint import CheckpointError, TensorReader, read_index
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

BASE = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "1", "--lr-decay-style",
        "constant", "--train-iters", "6", "--timeout-s", "60"]


def _losses(argv: list[str], resave: str | None = None) -> list[float]:
    """The run's losses; with ``resave``, what it loaded is first saved there as it stands (the
    loaded step, no training between), then the run trains from its --load as without."""
    trainer = Trainer(parse_args(BASE + argv))
    try:
        if resave is not None:
            ck = trainer.cfg.checkpoint
            step, own = trainer.maybe_load(), ck.save
            ck.save = resave
            try:
                trainer.save(step)
            finally:
                ck.save = own
        return [r["loss"] for r in trainer.train().records]
    finally:
        trainer.close()


# each resharding load: (its checkpoint, relative to the chain's root) -> where it was saved again
RESAVED = {"C": ("a/iter_0000003", "resaved/c/iter_0000003"),
           "D": ("c/iter_0000004", "resaved/d/iter_0000004"),
           "F": ("a/iter_0000003", "resaved/f/iter_0000003"),
           "H": ("g/iter_0000004", "resaved/h/iter_0000004")}


def chain(ps, root):
    a = os.path.join(root, "a")
    c = os.path.join(root, "c")

    def resave(run: str) -> str:
        return os.path.dirname(os.path.join(root, RESAVED[run][1]))
    out = {"A": _losses(["--tp", "2", "--pp", "2", "--use-distributed-optimizer", "--sequence-parallel",
                         "--save", a, "--save-interval", "3"])}
    ck3 = os.path.join(a, "iter_0000003")
    out["E"] = _losses(["--tp", "2", "--pp", "2", "--use-distributed-optimizer", "--sequence-parallel",
                        "--load", ck3])
    out["C"] = _losses(["--tp", "4", "--pp", "1", "--load", ck3, "--save", c, "--train-iters", "4"],
                       resave("C"))
    out["D"] = _losses(["--tp", "1", "--pp", "4", "--use-distributed-optimizer",
                        "--load", os.path.join(c, "iter_0000004")], resave("D"))
    out["F"] = _losses(["--tp", "2", "--pp", "2", "--pipeline-schedule", "interleaved",
                        "--virtual-pipeline-size", "2", "--load", ck3], resave("F"))
    g = os.path.join(root, "g")
    out["G"] = _losses(["--tp", "2", "--pp", "2", "--use-distributed-optimizer", "--zero-stage", "2",
                        "--sequence-parallel", "--load", ck3, "--save", g, "--save-interval", "1",
                        "--keep-last", "3"])
    out["H"] = _losses(["--tp", "2", "--pp", "1", "--load", os.path.join(g, "iter_0000004")],
                       resave("H"))
    return out


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    results = run_distributed(chain, grid=RankGrid(tp=2, pp=2, dp=2), args=(root,), timeout_s=120)
    return root, results[0]


def close(got, want, rel=1e-4):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rel * abs(w), (got, want)


def test_same_layout_resume_is_bit_identical(resharded):
    _, r = resharded
    assert r["E"] == r["A"][3:]
    assert r["G"] == r["A"][3:]          # ZeRO-1 -> ZeRO-2: the same logical pieces, the same math


def test_resume_across_layouts(resharded):
    root, r = resharded
    close(r["C"], r["A"][3:4])
    close(r["D"], r["A"][4:])
    close(r["F"], r["A"][3:])
    close(r["H"], r["A"][4:])
    with pytest.raises(CheckpointError, match="is at step 6 and --train-iters is 6: nothing to train"):
        _losses(["--load", os.path.join(root, "a")])  # latest = step 6
    close(_losses(["--load", os.path.join(root, "a", "iter_0000003")]), r["A"][3:])


def logical_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Every model and optimizer logical tensor of a checkpoint, read whole (float64: exact)."""
    index = read_index(ckpt)
    reader = TensorReader(ckpt, index)
    return {name: reader.read(name, [0] * len(e["shape"]), e["shape"], dtype=torch.float64)
            for name, e in index["tensors"].items() if name.startswith(("model/", "optim/"))}


@pytest.mark.parametrize("run", sorted(RESAVED))
def test_resharded_loads_hold_every_logical_tensor(resharded, run):
    """What a layout loaded from another's checkpoint, saved again at once, is that checkpoint:
    the model and both moments (and masters where stored) of every parameter, element for
    element."""
    root, _ = resharded
    source, again = (os.path.join(root, p) for p in RESAVED[run])
    want, got = logical_tensors(source), logical_tensors(again)
    assert sorted(got) == sorted(want), (run, sorted(set(got) ^ set(want)))
    assert any(n.startswith("optim/exp_avg/") for n in want) and \
        any(n.startswith("optim/exp_avg_sq/") for n in want), sorted(want)
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, (run, differ)


def test_index_records_pieces_and_layout(resharded):
    root, _ = resharded
    with open(os.path.join(root, "a", "iter_0000003", "index.json")) as fh:
        index = json.load(fh)
    assert index["step"] == 3 and index["layout"]["tp"] == 2 and index["layout"]["use_distributed_optimizer"]
    assert sorted(index["files"]) == [f"rank_{r:05d}.safetensors" for r in range(8)]
    qkv = index["tensors"]["model/layers.0.attn.qkv.weight"]
    assert qkv["shape"] == [192, 64] and len(qkv["pieces"]) == 2  # tp 0 and 1 of stage 0, dp rank 0
    word = index["tensors"]["model/embedding.word.weight"]
    assert word["shape"] == [300, 64]  # padding rows (300 -> 512 at tp 2) are not stored
    assert sum(p["shape"][0] for p in word["pieces"]) == 300  # the last stage's tied copy is not stored
    optim = {n: e for n, e in index["tensors"].items() if n.startswith("optim/")}
    # fp32 under ZeRO: the parameter shards are the masters (parallel/dp/master.py), not stored twice
    assert {n.split("/")[1] for n in optim} == {"exp_avg", "exp_avg_sq"}
    for name, entry in optim.items():  # pieces tile each tensor exactly once
        stored = sum(p["flat"][1] - p["flat"][0] if "flat" in p else math.prod(p["shape"])
                     for p in entry["pieces"])
        assert stored == math.prod(entry["shape"]), name
    assert any("flat" in p for e in optim.values() for p in e["pieces"])  # ZeRO-1 ranges
    with open(os.path.join(root, "c", "iter_0000004", "index.json")) as fh:
        c_index = json.load(fh)
    assert not any("flat" in p for n, e in c_index["tensors"].items() for p in e["pieces"])
    assert "optim/master/layers.0.attn.qkv.weight" not in c_index["tensors"]  # fp32: params are masters
