"""Expert tensor parallelism (``--expert-tensor-parallel-size`` = tp): every expert split over the
TP group like the dense MLP, through the real trainer, against the serial trainer.

fp32, one seed, mock data: the per-step token loss, the balancing losses as
trained (``moe_aux_loss``, ``moe_z_loss``) and the gradient norm agree with the serial run to a
relative 1e-4 over 20 steps, the per-expert load and the dropped assignments exactly:

- tp 2, etp 2, dp 2, ep 2 and ep 1; gelu experts with biases (gpt2 blocks, the global aux loss
  with one micro-batch per rank, the z-loss, a shared expert) and swiglu experts (llama blocks,
  the per-sequence aux loss, sigmoid scores, 2 micro-batches per rank); ``--moe-grouped-gemm`` on
  the ep 1 runs (the grouped path stacks the sharded weights), the loop on the ep 2 runs; the
  alltoall dispatcher with gelu, the allgather one with swiglu (and a padded capacity that
  drops assignments); ZeRO-1 on the gelu ep 1 run; with sequence parallelism gelu at ep 2
  (alltoall) and swiglu at ep 1 (allgather, the padded capacity, grouped GEMM): each TP rank
  routes its own shard and the slices compute the TP group's gathered tokens;
- a checkpoint saved at etp 2 (step 10) resumes at etp 1 (tp 2, dp 2, ep 2) with the
  uninterrupted run's losses, and that run's checkpoint (step 15) back at etp 2 with ep 1; the
  index holds each expert weight as its logical tensor, in one piece per TP rank.

One spawned group of 4 ranks runs every layout in sequence; the serial runs go first, in this
process. In one process: the ETP groups are the TP groups; an expert's ETP slices draw the rows
and columns of the whole expert and their partial outputs sum to its output, the fc2 bias once
(loop and grouped paths); and the bad input (etp neither 1 nor tp, an expert width that does
not split) is refused in one line.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from models.config import GPTConfig
from models.layers import LayerContext
from models.logical import logical_views
from models.moe.experts import LocalExperts
from parallel.grid.expert_groups import ExpertGrid
from parallel.grads.norm import global_grad_norm
from parallel.grid.launch import LaunchEnv
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed

STEPS, REL, SAVED, MIDDLE = 20, 1e-4, 10, 15
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--global-batch-size", "8", "--train-iters", str(STEPS), "--precision", "fp32",
        "--lr", "1e-2", "--lr-warmup-iters", "0", "--timeout-s", "120",
        "--lr-decay-iters", str(STEPS),  # the same schedule for a run stopped at step 15
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.05",
        "--moe-z-loss-coeff", "1e-3", "--moe-ffn-hidden-size", "24"]
GPT2 = ["--block", "gpt2", "--num-layers", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-shared-expert-intermediate-size", "16"]
LLAMA = ["--block", "llama", "--num-layers", "2", "--moe-router-load-balancing-type",
         "seq_aux_loss", "--moe-router-score-function", "sigmoid"]
# a capacity that drops assignments, each expert padded to it (the same micro-batches serially)
CAPACITY = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
ETP = ["--tp", "2", "--etp", "2", "--dp", "2"]
GROUPED = ["--moe-grouped-gemm"]
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_expert_load", "moe_tokens_dropped")


def mbs(n: int) -> list[str]:
    return ["--micro-batch-size", str(n)]


# (name, model flags, serial micro-batch size, layout flags); "{root}" is the checkpoint root
LAYOUTS = [
    ("gelu etp2 ep2", GPT2, 8, [*ETP, "--ep", "2", *mbs(4), "--save", "{root}/a",
                                "--save-interval", str(SAVED)]),
    ("swiglu etp2 ep2 allgather capacity", LLAMA + CAPACITY, 2,
     [*ETP, "--ep", "2", *mbs(2), "--moe-token-dispatcher-type", "allgather"]),
    ("gelu etp2 ep1 grouped zero", GPT2, 8, [*ETP, *mbs(4), *GROUPED,
                                             "--use-distributed-optimizer"]),
    ("swiglu etp2 ep1 grouped", LLAMA, 2, [*ETP, *mbs(2), *GROUPED]),
    # with sequence parallelism: each TP rank routes its shard, the slices see the TP group's tokens
    ("gelu etp2 ep2 sp", GPT2, 8, [*ETP, "--ep", "2", *mbs(4), "--sequence-parallel"]),
    ("swiglu etp2 ep1 sp allgather capacity grouped", LLAMA + CAPACITY, 2,
     [*ETP, *mbs(2), "--sequence-parallel", "--moe-token-dispatcher-type", "allgather", *GROUPED]),
]
RESUMES = [  # (name, layout flags, the steps of the first run they continue)
    ("etp1 from etp2", ["--tp", "2", "--dp", "2", "--ep", "2", *mbs(4), "--load",
                        f"{{root}}/a/iter_{SAVED:07d}", "--save", "{root}/b", "--save-interval",
                        str(MIDDLE), "--train-iters", str(MIDDLE)], slice(SAVED, MIDDLE)),
    ("etp2 from etp1", [*ETP, *mbs(4), "--load", f"{{root}}/b/iter_{MIDDLE:07d}"],
     slice(MIDDLE, STEPS)),
]


def _train(argv: list[str], launch: LaunchEnv | None = None) -> dict:
    trainer = Trainer(parse_args(BASE + argv), launch=launch)
    try:
        records = trainer.train().records
        ps, opt = trainer.ps, trainer.optimizer
        params = [p for chunk in trainer.chunks for p in chunk.parameters()]
        share = opt.grad_norm_sq_share()  # the last step's gradients, three ways
        ps.world_group.all_reduce(share)
        norms = [global_grad_norm(params, ps), opt.grad_norm(), share.sqrt().item()]
        fc2_bias = [t.detach().clone() for n, t in logical_views(trainer.chunks[0]).items()
                    if n.endswith(".fc2.bias") and ".experts." in n]
        etp_sp = {m.etp_sp for c in trainer.chunks for m in c.modules() if hasattr(m, "etp_sp")}
    finally:
        trainer.close()
    return {**{k: [r[k] for r in records] for k in KEYS}, "etp": ps.etp_group.size,
            "norms": norms, "fc2_bias": fc2_bias, "etp_sp": etp_sp}


def _layouts(ps, root: str) -> dict:
    fill = lambda flags: [f.replace("{root}", root) for f in flags]  # noqa: E731
    runs = {name: _train(model + fill(flags)) for name, model, _, flags in LAYOUTS}
    runs.update({name: _train(GPT2 + fill(flags)) for name, flags, _ in RESUMES})
    return runs


def _close(name: str, key: str, got: list, want: list) -> None:
    assert len(got) == len(want) > 0, (name, key)
    for step, (x, w) in enumerate(zip(got, want), start=1):
        assert abs(x - w) <= REL * abs(w), f"{name}: {key} at step {step} is {x}, serial {w}"


def test_etp_equals_serial_and_checkpoints_reshard(tmp_path):
    serial = {}
    for _, model, serial_mbs, _ in LAYOUTS:
        key = (tuple(model), serial_mbs)
        if key not in serial:
            serial[key] = _train(model + mbs(serial_mbs), launch=LaunchEnv())
    ranks = run_distributed(_layouts, grid=RankGrid(dp=4), args=(str(tmp_path),), timeout_s=300)
    runs = ranks[0]
    for name, model, serial_mbs, _ in LAYOUTS:
        got, ref = runs[name], serial[(tuple(model), serial_mbs)]
        assert got["etp"] == 2 and len(ref["loss"]) == STEPS, name
        assert got["etp_sp"] == {" sp" in name}, name  # the shards gathered for the slices
        assert got["norms"][0] > 0, name  # grad_norm.py, the optimizer's norm and its shares
        _close(name, "last norm", got["norms"][1:], got["norms"][:1] * 2)
        # the fc2 bias is whole on both TP ranks (0 and 1) and stays equal (its gradient summed)
        assert (len(got["fc2_bias"]) > 0) == name.startswith("gelu"), name   # biases: gelu only
        assert all(torch.equal(a, b) for a, b in zip(got["fc2_bias"], ranks[1][name]["fc2_bias"]))
        assert all(v > 0 for v in ref["moe_aux_loss"] + ref["moe_z_loss"])
        for key in KEYS[:4]:
            _close(name, key, got[key], ref[key])
        for key in KEYS[4:]:  # counts: exactly
            assert got[key] == ref[key], (name, key)
        assert (sum(ref["moe_tokens_dropped"]) > 0) == ("capacity" in name), name
    first = runs[LAYOUTS[0][0]]
    for name, _, steps in RESUMES:
        _close(name, "loss", runs[name]["loss"], first["loss"][steps])
        _close(name, "grad_norm", runs[name]["grad_norm"], first["grad_norm"][steps])
    assert [runs[name]["etp"] for name, _, _ in RESUMES] == [1, 2]
    assert len(first["fc2_bias"]) == 4 and all(b.abs().sum() > 0 for b in first["fc2_bias"])
    with open(tmp_path / "a" / f"iter_{SAVED:07d}" / "index.json") as fh:
        tensors = json.load(fh)["tensors"]
    for part, shape in (("fc1.weight", [24, 32]), ("fc1.bias", [24]), ("fc2.weight", [32, 24])):
        entry = tensors[f"model/layers.1.mlp.experts.experts.3.{part}"]
        assert entry["shape"] == shape and len(entry["pieces"]) == 2, (part, entry)
    assert len(tensors["model/layers.1.mlp.experts.experts.3.fc2.bias"]["pieces"]) == 1


@pytest.mark.parametrize("kind,grouped", [("gelu", False), ("gelu", True), ("swiglu", True)])
def test_etp_slices_sum_to_the_whole_expert(kind, grouped):
    cfg = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                    vocab_size=16, num_experts=4, moe_ffn_hidden_size=12,
                    moe_grouped_gemm=grouped)
    ctx = LayerContext(Initializer(3, cfg.init_std))
    bias = kind == "gelu"
    whole = LocalExperts(cfg, ctx, "e", kind, bias, range(2, 4))
    parts = [LocalExperts(cfg, ctx, "e", kind, bias, range(2, 4), (r, 2)) for r in range(2)]
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))  # biases nonzero too
        full = logical_views(whole)
        for r, part in enumerate(parts):  # each logical tensor's slice along its TP dim
            for p in part.parameters():
                for lp in p.logical_parts:
                    src = full[lp.name]
                    lp.view(p).copy_(src if lp.shard_dim is None else src.chunk(2, lp.shard_dim)[r])
    dims = {lp.name.split(".", 2)[2]: lp.shard_dim for p in parts[0].parameters()
            for lp in p.logical_parts if lp.name.startswith("experts.2.")}
    assert dims == ({"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None} if bias
                    else {"gate.weight": 0, "up.weight": 0, "fc2.weight": 1})
    assert all(getattr(p, "tp_sharded", False) == any(lp.shard_dim is not None for lp in p.logical_parts)
               for p in parts[0].parameters())
    assert not any(getattr(p, "tp_sharded", False) for p in whole.parameters())
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(0))
    offsets = torch.tensor([3, 7], dtype=torch.int32)
    want = whole(x, offsets)
    got = parts[0](x, offsets) + parts[1](x, offsets)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(parts[0](x, offsets), want, atol=1e-3)


def test_etp_draws_the_whole_experts_slices():
    cfg = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=4,
                    vocab_size=16, num_experts=2, moe_ffn_hidden_size=12)
    ctx = LayerContext(Initializer(5, cfg.init_std))
    whole = logical_views(LocalExperts(cfg, ctx, "e", "swiglu", False, range(2)))
    for r in range(2):
        part = LocalExperts(cfg, ctx, "e", "swiglu", False, range(2), (r, 2))
        for p in part.parameters():
            for lp in p.logical_parts:
                assert torch.equal(lp.view(p), whole[lp.name].chunk(2, lp.shard_dim)[r]), lp.name


def test_etp_groups_are_the_tp_groups():
    eg = ExpertGrid(RankGrid(tp=2, dp=4), ep=2, etp=2)
    assert eg.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert eg.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]   # as with etp 1
    assert eg.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ExpertGrid(RankGrid(tp=2, dp=4), ep=2).groups("etp") == [[r] for r in range(8)]
    with pytest.raises(ValueError, match="only 1 .* or --tp 4"):
        ExpertGrid(RankGrid(tp=4, dp=2), ep=2, etp=2)


@pytest.mark.parametrize("argv,message", [
    (["--tp", "2", "--etp", "4"], "--expert-tensor-parallel-size 4: only 1 (each expert whole on "
                                  "one rank) or --tp 2"),
    (["--etp", "2"], "--expert-tensor-parallel-size 2: only 1 (each expert whole on one rank) "
                     "or --tp 1"),
    (["--tp", "2", "--etp", "2", "--moe-ffn-hidden-size", "25"],
     "--moe-ffn-hidden-size 25 is not divisible by --expert-tensor-parallel-size 2"),
])
def test_bad_etp_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(["--num-experts", "4", *argv])
    assert message in str(err.value) and "\n" not in str(err.value)
