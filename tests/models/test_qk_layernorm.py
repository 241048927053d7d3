"""--qk-layernorm: RMSNorm over each head's query and key, before RoPE.

- TP 2 against the serial model (one spawned group of 2 gloo ranks): three SGD steps of a llama
  model with grouped-query attention (one key/value group per TP rank), a gpt2 model and a llama
  model with an MoE layer, each with --qk-layernorm; every step's loss (relative 1e-4) and every
  gradient after gathering the shards equal the serial run's. The norm weights' gradients are
  partial on each TP rank (its own heads) and summed over TP by the engine's step
  (``sync_sequence_parallel_grads``): the trained weights equal the serial ones on both ranks.
- transformers: a tiny random Qwen3 model (q_norm / k_norm over head_dim, non-unit weights)
  imported with ``engine.import_hf`` gives transformers' logits (and other ones without the norms);
  exported back as Qwen3 it is the same tensors; a run without the flag cannot load it.
- the flag and the parameter names.
"""
from __future__ import annotations

import pytest
import torch

from engine.config.cli import parse_args
from models import GPTChunk, GPTConfig, LayerContext
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.models.test_gqa import GRAD_TOL, SEED, train
from tests.parallel.tensor_parallel.test_tp_layers import full_tensor

# (name, block, heads, query groups, MoE)
CASES = [("llama-gqa", "llama", 4, 2, False), ("gpt2", "gpt2", 4, 4, False),
         ("llama-moe", "llama", 4, 2, True)]




def config(block: str, heads: int, groups: int, moe: bool) -> GPTConfig:
    extra = dict(num_experts=4, moe_router_topk=2, moe_layer_freq="[0,1]",
                 moe_ffn_hidden_size=32) if moe else {}
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                     seq_length=16, vocab_size=300, block=block, seed=SEED, qk_layernorm=True, **extra)


def _norm_weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".attn." in n and "_norm." in n}


def check_tp2(ps: ParallelState, refs: dict) -> dict:
    out = {}
    for name, block, heads, groups, moe in CASES:
        ref, cfg = refs[name], config(block, heads, groups, moe)
        losses, grads, model = train(cfg, ps, packed=False)
        for step, (got, want) in enumerate(zip(losses, ref["losses"])):
            assert abs(got - want) <= 1e-4 * abs(want), f"{name} step {step + 1}: {got} vs {want}"
        params = dict(model.named_parameters())
        for step, (local, serial) in enumerate(zip(grads, ref["grads"])):
            for pname, g in local.items():
                full = full_tensor(g, serial[pname], params[pname], ps, cfg.vocab_size, summed=True)
                torch.testing.assert_close(full, serial[pname][: full.shape[0]], **GRAD_TOL,
                                           msg=lambda m: f"{name} step {step + 1} {pname}: {m}")
        out[name] = _norm_weights(model)
    return out


def test_qk_layernorm_under_tp2_matches_serial():
    refs, trained = {}, {}
    for name, block, heads, groups, moe in CASES:
        losses, grads, model = train(config(block, heads, groups, moe), ParallelState.serial(), False)
        refs[name] = {"losses": losses, "grads": grads}
        trained[name] = _norm_weights(model)
        names = sorted(trained[name])
        assert names == [f"layers.{i}.attn.{k}_norm.weight" for i in (0, 1) for k in "kq"], names
        # the norms train (a gradient that moved them), so the TP check below compares something
        assert all((w - 1).abs().max() > 5e-4 for w in trained[name].values()), name
    results = run_distributed(check_tp2, grid=RankGrid(tp=2), args=(refs,))
    for name in refs:
        for rank in (0, 1):  # the replicas agree with each other and with the serial weights
            for pname, w in results[rank][name].items():
                torch.testing.assert_close(w, trained[name][pname], **GRAD_TOL,
                                           msg=lambda m: f"{name} rank {rank} {pname}: {m}")


def test_qk_layernorm_matches_transformers_qwen3(tmp_path):
    transformers = pytest.importorskip("transformers")
    from engine.checkpoint.import_hf import main as import_main
    from engine.tools.generate import load_model
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=32, tie_word_embeddings=False)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, and norm weights away from 1
        for n, p in ref.named_parameters():
            p.normal_(0.0, 0.2) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    ref.save_pretrained(str(tmp_path / "qwen3"))
    assert import_main(["--load", str(tmp_path / "qwen3"), "--save", str(tmp_path / "ck")]) == 0
    ours, index, _ = load_model(str(tmp_path / "ck"))
    assert index["model"]["qk_layernorm"] and index["model"]["num_query_groups"] == 2
    attn = ours.layers[0].attn
    assert torch.equal(attn.q_norm.weight, ref.model.layers[0].self_attn.q_norm.weight)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).logits
        got = ours(x)[..., :96]
        assert want.abs().max() > 1.0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        attn.q_norm = attn.k_norm = None  # without the norms the model is another one
        assert (ours(x)[..., :96] - want).abs().max() > 1e-2
    from safetensors.torch import load_file
    from engine.export import main as export_main
    assert export_main(["--load", str(tmp_path / "ck"), "--to", "hf", "--out", str(tmp_path / "out")]) == 0
    original, exported = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("qwen3", "out"))
    assert sorted(original) == sorted(exported)  # q_norm / k_norm written back as Qwen3's
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "out")).model_type == "qwen3"
    # a run that forgets the flag would skip the norms: loading it is refused in one line
    from engine.checkpoint.index import CheckpointError
    from engine.checkpoint.reader import check_compatible
    argv = ["--block", "llama", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32",
            "--mock-data", "--vocab-size", "96", "--norm-eps", str(cfg.rms_norm_eps),
            "--rope-base", str(index["model"]["rope_base"])]
    with pytest.raises(CheckpointError, match="saved with --qk-layernorm, this run without"):
        check_compatible(index, parse_args(argv), index["data"], "ck")
    check_compatible(index, parse_args(argv + ["--qk-layernorm"]), index["data"], "ck")


def test_the_flag_builds_the_norms():
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "64", "--block", "llama"]
    assert not parse_args(base).model.qk_layernorm
    cfg = parse_args(base + ["--qk-layernorm"]).model
    assert cfg.qk_layernorm
    chunk = GPTChunk(cfg, ParallelState.serial(), LayerContext(Initializer(SEED)), range(1))
    shapes = {n: tuple(p.shape) for n, p in chunk.logical_named_parameters() if ".attn." in n and "_norm" in n}
    assert shapes == {"layers.0.attn.q_norm.weight": (8,), "layers.0.attn.k_norm.weight": (8,)}
