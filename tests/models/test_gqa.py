"""Grouped-query attention (--num-query-groups G): tensor parallelism against the serial model,
checkpoint export against transformers, and the configuration checks.

- TP: one spawned group of 4 gloo ranks replays serial SGD runs with tp=2 and tp=4 for G < heads
  (llama with sequence parallelism, gpt2 without), on plain and on packed-document batches, and
  compares every step's loss (relative 1e-4) and every gradient after gathering the shards; each
  rank's QKV shard holds whole key/value groups, a contiguous slice of the serial weight.
- Export: llama with G = 1 (multi-query), 2 and heads writes ``num_key_value_heads`` = G, and
  LlamaForCausalLM's logits equal ours; gpt2 with G = 2 exports as multi-head attention and
  GPT2LMHeadModel's logits equal ours. ``split_qkv`` and ``fuse_qkv`` invert each other.
- Bad G: not dividing the heads, not divisible by tp, --group-query-attention without G.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine.checkpoint.export import fuse_qkv, split_qkv
from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.data.packing import PackingConfig, micro_batch
from engine.export import main as export_main
from engine.tools.generate import load_model
from engine.training.step import sync_sequence_parallel_grads
from engine.training.trainer import Trainer
from engine.training.validate import validate_run
from models import GPTChunk, GPTConfig, LayerContext
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.parallel.tensor_parallel.test_tp_layers import full_tensor
from tests.parallel.tensor_parallel.test_tp_mappings import tp_states

SEED, STEPS, LR, BATCH, EOD = 5, 3, 1.0, 2, 299
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
# (block, heads, groups, tp, sequence parallel)
LAYOUTS = [("llama", 4, 2, 2, True), ("gpt2", 4, 2, 2, False), ("llama", 8, 4, 4, True),
           ("gpt2", 8, 2, 2, True)]
PACK = PackingConfig(EOD, reset_attention_mask=True, reset_position_ids=True)


def config(block: str, heads: int, groups: int | None) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                     seq_length=16, vocab_size=300, block=block, seed=SEED)


def batches(packed: bool) -> list:
    """STEPS micro-batches of random tokens; packed ones hold three end-of-document tokens a row."""
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, EOD, (BATCH, 17), generator=gen)
        if packed:
            seq[:, [3, 8, 9]] = EOD  # documents of 4, 5, 1 and 7 tokens (one-token ones included)
        out.append(micro_batch(seq, PACK if packed else None))
    return out


def train(cfg: GPTConfig, ps: ParallelState, packed: bool, sp: bool = False):
    """STEPS SGD steps: per-step losses, per-step {name: local grad}, and the model."""
    ctx = LayerContext(Initializer(SEED, cfg.init_std), sequence_parallel=sp)
    model = GPTChunk(cfg, ps, ctx, range(cfg.num_layers))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for mb in batches(packed):
        opt.zero_grad(set_to_none=True)
        loss = model(mb.tokens, mb.labels, mb.inputs).mean()
        loss.backward()
        sync_sequence_parallel_grads(list(model.parameters()), ps)
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, model


def check_layouts(ps: ParallelState, refs: dict) -> int:
    states = tp_states(ps)
    checked = 0
    for (block, heads, groups, tp, sp), packed in refs:
        ref, sub, cfg = refs[(block, heads, groups, tp, sp), packed], states[tp], config(block, heads, groups)
        where = f"{block} n={heads} G={groups} tp={tp} sp={sp} packed={packed}"
        losses, grads, model = train(cfg, sub, packed, sp)
        for step, (got, want) in enumerate(zip(losses, ref["losses"])):
            assert abs(got - want) <= 1e-4 * abs(want), f"{where} step {step + 1}: {got} vs {want}"
        params = dict(model.named_parameters())
        for step, (local, serial) in enumerate(zip(grads, ref["grads"])):
            for name, g in local.items():
                full = full_tensor(g, serial[name], params[name], sub, cfg.vocab_size, summed=True)
                torch.testing.assert_close(full, serial[name][: full.shape[0]], **GRAD_TOL,
                                           msg=lambda m: f"{where} step {step + 1} {name}: {m}")
        # whole groups per rank: rank r holds rows of groups [r G/tp, (r+1) G/tp) of the serial weight
        rows = (heads + 2 * groups) * cfg.head_dim // tp
        qkv = model.layers[0].attn.qkv.weight
        assert qkv.shape[0] == rows, where
        torch.testing.assert_close(qkv, ref["qkv_after"][sub.tp_rank * rows:(sub.tp_rank + 1) * rows],
                                   **GRAD_TOL)
        checked += 1
    return checked


def test_grouped_query_attention_under_tp_matches_serial():
    refs = {}
    for layout in LAYOUTS:
        for packed in (False, True):
            block, heads, groups, _, _ = layout
            losses, grads, model = train(config(block, heads, groups), ParallelState.serial(), packed)
            refs[layout, packed] = {"losses": losses, "grads": grads,
                                    "qkv_after": model.layers[0].attn.qkv.weight.detach().clone()}
    for layout in LAYOUTS:  # packing changes the losses: the packed runs test something of their own
        assert abs(refs[layout, True]["losses"][0] - refs[layout, False]["losses"][0]) > 1e-3
    results = run_distributed(check_layouts, grid=RankGrid(tp=4), args=(refs,))
    assert results == [len(refs)] * 4


# ---- export -----------------------------------------------------------------------------------
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--no-progress", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--mock-data", "--vocab-size", "300", "--train-iters", "2",
        "--device", "cpu", "--peak-tflops", "1"]


@pytest.mark.parametrize("block, groups", [("llama", 1), ("llama", 2), ("llama", 4), ("gpt2", 2)])
def test_export_with_query_groups_matches_transformers(tmp_path, block, groups):
    transformers = pytest.importorskip("transformers")
    save = str(tmp_path / "ck")
    trainer = Trainer(parse_args(TINY + ["--block", block, "--num-query-groups", str(groups),
                                         "--save", save]), launch=LaunchEnv())
    try:
        trainer.train()
    finally:
        trainer.close()
    out = str(tmp_path / "hf")
    assert export_main(["--load", save, "--to", "hf", "--out", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    if block == "llama":
        assert config["num_key_value_heads"] == groups and config["num_attention_heads"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if block == "llama":
        assert hf.model.layers[0].self_attn.k_proj.weight.shape == (groups * 16, 64)
    ours, index, _ = load_model(save)
    assert index["model"]["num_query_groups"] == groups
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens)[..., :300]
        got = hf(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_split_and_fuse_qkv_invert_each_other():
    n, g, d, h = 8, 2, 3, 5
    w = torch.arange((n + 2 * g) * d * h, dtype=torch.float32).view(-1, h)
    q, k, v = split_qkv(w, n, g)
    assert q.shape == (n * d, h) and k.shape == v.shape == (g * d, h)
    # group 1 starts at row (n/g + 2) d: its first query head is query head n/g
    assert torch.equal(q[(n // g) * d], w[(n // g + 2) * d]) and torch.equal(k[d], w[(2 * (n // g) + 2) * d])
    assert torch.equal(fuse_qkv(q, k, v, n, g), w)
    bias = torch.arange((n + 2 * g) * d, dtype=torch.float32)
    assert torch.equal(fuse_qkv(*split_qkv(bias, n, g), n, g), bias)
    mha = torch.randn(3 * n * d, h)  # G = n keeps the multi-head layout (head, q|k|v, d)
    assert torch.equal(split_qkv(mha, n)[1][:d], mha[d:2 * d])


# ---- configuration ----------------------------------------------------------------------------
def test_bad_query_groups_fail_with_what_to_change():
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "64"]
    with pytest.raises(ConfigError, match="--num-query-groups 3 must be a positive divisor of --num-attention-heads 4"):
        parse_args(base + ["--num-query-groups", "3"])
    with pytest.raises(ConfigError, match="--group-query-attention needs --num-query-groups"):
        parse_args(base + ["--group-query-attention"])
    assert parse_args(base + ["--group-query-attention", "--num-query-groups", "2"]).model.kv_hidden_size == 16
    assert parse_args(base).model.num_query_groups == 4  # default: one group per head
    with pytest.raises(ConfigError, match="--num-query-groups 1 is not divisible by --tp 2.*whole key/value groups"):
        validate_run(parse_args(base + ["--tp", "2", "--num-query-groups", "1"]), LaunchEnv(0, 2, 0, 2))
    validate_run(parse_args(base + ["--tp", "2", "--num-query-groups", "2"]), LaunchEnv(0, 2, 0, 2))
    with pytest.raises(ValueError, match=r"--num-query-groups \(1\) is not divisible by tp=2"):
        GPTChunk(config("llama", 4, 1), ParallelState(RankGrid(tp=2)), LayerContext(Initializer(SEED)),
                 range(2))
