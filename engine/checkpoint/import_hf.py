"""``python -m engine.import_hf --load HF_DIR --save CKPT_DIR``: a Hugging Face transformers GPT-2 or
Llama checkpoint (safetensors) becomes a gridtron checkpoint, the mirror of ``engine.export``.

The model configuration is read from ``config.json``; the weights from ``model.safetensors`` (or
the shards listed by ``model.safetensors.index.json``); the tokenizer files are copied. The result
is a checkpoint of step 0 holding the full logical tensors, so it loads under any layout
(``--load CKPT_DIR --use-checkpoint-args``) and continued pretraining starts from these weights
with a fresh optimizer. The weight mapping is export.py's, inverted: GPT-2's Conv1D weights are
(in, out) and transposed; the q, k and v projections are interleaved per head into our fused QKV
rows (head, q|k|v, head_dim), so whole heads stay together under TP. Rotary embeddings need no
permutation (both sides rotate halves). Grouped-query attention (num_key_value_heads <
num_attention_heads) is refused with a clear error until the model supports it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import torch
from safetensors import safe_open

from engine.checkpoint.index import (FORMAT, INDEX_NAME, CheckpointError, sha256_file,
                                     step_dir_name, write_json, write_shard)
from engine.checkpoint.export import fuse_qkv
from engine.checkpoint.writer import promote
from models.config import GPTConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    single = os.path.join(hf_dir, "model.safetensors")
    sharded = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(sharded):
        with open(sharded, encoding="utf-8") as fh:
            files = sorted({os.path.join(hf_dir, f) for f in json.load(fh)["weight_map"].values()})
    elif any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("pytorch_model.bin", "model.bin")):
        raise CheckpointError(f"{hf_dir} holds pickled PyTorch weights; this importer reads safetensors "
                              f"only: re-save with model.save_pretrained(DIR) (safetensors by default)")
    else:
        raise CheckpointError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _require(cond: bool, what: str, hf_dir: str) -> None:
    if not cond:
        raise CheckpointError(f"{hf_dir}: {what}")


def _gpt2(c: dict, w: dict, hf_dir: str) -> tuple[GPTConfig, dict]:
    act = c.get("activation_function", "gelu_new")
    _require(act in ("gelu_new", "gelu_pytorch_tanh"), f"activation {act!r} is not supported (our "
             f"GPT-2 block uses the tanh GELU, gelu_new)", hf_dir)
    _require(not c.get("scale_attn_by_inverse_layer_idx") and not c.get("reorder_and_upcast_attn"),
             "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported", hf_dir)
    _require(c.get("scale_attn_weights", True), "scale_attn_weights=false is not supported", hf_dir)
    _require(c.get("tie_word_embeddings", True), "an untied GPT-2 output layer is not supported", hf_dir)
    h, n, layers = c["n_embd"], c["n_head"], c["n_layer"]
    cfg = GPTConfig(num_layers=layers, hidden_size=h, num_attention_heads=n,
                    ffn_hidden_size=c.get("n_inner") or 4 * h, seq_length=c["n_positions"],
                    max_position_embeddings=c["n_positions"], vocab_size=c["vocab_size"], block="gpt2",
                    norm_eps=c.get("layer_norm_epsilon", 1e-5))
    w = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in w.items()}
    sd = {"embedding.word.weight": w["wte.weight"], "embedding.position": w["wpe.weight"],
          "final_norm.weight": w["ln_f.weight"], "final_norm.bias": w["ln_f.bias"]}
    for i in range(layers):
        src, dst = f"h.{i}", f"layers.{i}"
        qkv_w = w[f"{src}.attn.c_attn.weight"].t()  # Conv1D (h, 3h) -> (3h, h) = q | k | v
        sd[f"{dst}.attn.qkv.weight"] = fuse_qkv(*qkv_w.split(h), n, n)
        sd[f"{dst}.attn.qkv.bias"] = fuse_qkv(*w[f"{src}.attn.c_attn.bias"].split(h), n, n)
        for theirs, ours in (("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            sd[f"{dst}.{ours}.weight"] = w[f"{src}.{theirs}.weight"].t()
            sd[f"{dst}.{ours}.bias"] = w[f"{src}.{theirs}.bias"]
        for theirs, ours in (("ln_1", "norm1"), ("ln_2", "norm2")):
            sd[f"{dst}.{ours}.weight"] = w[f"{src}.{theirs}.weight"]
            sd[f"{dst}.{ours}.bias"] = w[f"{src}.{theirs}.bias"]
    return cfg, sd


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if kind not in ("default", None):
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _llama(c: dict, w: dict, hf_dir: str) -> tuple[GPTConfig, dict]:
    h, n, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    kv = c.get("num_key_value_heads") or n
    _require(kv == n, f"grouped-query attention (num_key_value_heads {kv} < num_attention_heads {n}) "
             f"is not supported yet; import a checkpoint whose every head has its own keys and values",
             hf_dir)
    _require(c.get("head_dim", h // n) == h // n, f"head_dim {c.get('head_dim')} != hidden_size / "
             f"num_attention_heads = {h // n} is not supported", hf_dir)
    _require(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.get('hidden_act')!r} is not "
             f"supported (SwiGLU uses silu)", hf_dir)
    _require(not c.get("attention_bias") and not c.get("mlp_bias"), "attention or MLP biases are not "
             "supported by the llama block", hf_dir)
    try:
        theta = _rope_theta(c)
    except ValueError as exc:
        raise CheckpointError(f"{hf_dir}: {exc}") from exc
    cfg = GPTConfig(num_layers=layers, hidden_size=h, num_attention_heads=n,
                    ffn_hidden_size=c["intermediate_size"], seq_length=c["max_position_embeddings"],
                    max_position_embeddings=c["max_position_embeddings"], vocab_size=c["vocab_size"],
                    block="llama", norm_eps=c.get("rms_norm_eps", 1e-6), rope_base=theta)
    embed = w["model.embed_tokens.weight"]
    out = w.get("lm_head.weight")
    if out is None:
        _require(c.get("tie_word_embeddings", False), "lm_head.weight is missing", hf_dir)
        out = embed.clone()  # our llama block keeps an untied output layer: start it equal
    sd = {"embedding.word.weight": embed, "final_norm.weight": w["model.norm.weight"],
          "output.weight": out}
    for i in range(layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        a = f"{src}.self_attn"
        sd[f"{dst}.attn.qkv.weight"] = fuse_qkv(w[f"{a}.q_proj.weight"], w[f"{a}.k_proj.weight"],
                                                w[f"{a}.v_proj.weight"], n, kv)
        sd.update({f"{dst}.attn.proj.weight": w[f"{a}.o_proj.weight"],
                   f"{dst}.mlp.gate.weight": w[f"{src}.mlp.gate_proj.weight"],
                   f"{dst}.mlp.up.weight": w[f"{src}.mlp.up_proj.weight"],
                   f"{dst}.mlp.fc2.weight": w[f"{src}.mlp.down_proj.weight"],
                   f"{dst}.norm1.weight": w[f"{src}.input_layernorm.weight"],
                   f"{dst}.norm2.weight": w[f"{src}.post_attention_layernorm.weight"]})
    return cfg, sd


IMPORTERS = {"gpt2": _gpt2, "llama": _llama}


def _tokenizer_facts(out_dir: str) -> dict:
    from engine.data.hf_tokenizer import load_hf_tokenizer
    path = os.path.join(out_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return {"tokenizer": None, "eot_id": None, "tokenizer_sha256": None}
    tok = load_hf_tokenizer(out_dir)
    return {"tokenizer": "hf", "eot_id": tok.eot_id, "tokenizer_sha256": sha256_file(path)}


def import_hf(hf_dir: str, save: str) -> str:
    """Write ``save/iter_0000000`` (and ``save/latest``); return the checkpoint directory."""
    from engine.config.schema import CompressionConfig, RunConfig
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} has no config.json: pass a directory written by transformers' "
                              f"save_pretrained")
    with open(path, encoding="utf-8") as fh:
        c = json.load(fh)
    kind = c.get("model_type")
    if kind not in IMPORTERS:
        raise CheckpointError(f"{hf_dir}: model_type {kind!r} is not supported; gpt2 and llama are")
    try:
        cfg, sd = IMPORTERS[kind](c, read_hf_weights(hf_dir), hf_dir)
    except KeyError as exc:
        raise CheckpointError(f"{hf_dir}: weight {exc} is missing from the safetensors files") from exc
    final = os.path.join(save, step_dir_name(0))
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tmp, name))
    tensors = {f"model/{k}": v.contiguous() for k, v in sd.items()}
    fname = "rank_00000.safetensors"
    info = write_shard(tensors, os.path.join(tmp, fname))
    entries = {k: {"shape": list(v.shape), "dtype": str(v.dtype)[6:],
                   "pieces": [{"file": fname, "key": k, "offsets": [0] * v.ndim, "shape": list(v.shape)}]}
               for k, v in tensors.items()}
    data = {"vocab_size": cfg.vocab_size, "mock": False, "prefix": None, "tokenizer_file": None,
            **_tokenizer_facts(tmp)}
    run = RunConfig(model=cfg)
    layout = {"tp": 1, "pp": 1, "dp": 1, "order": run.parallel.order, "virtual_pipeline_size": 1,
              "use_distributed_optimizer": False, "sequence_parallel": False, "world_size": 1,
              "precision": "fp32", "compression": dataclasses.asdict(CompressionConfig())}
    write_json(os.path.join(tmp, INDEX_NAME), {
        "format": FORMAT, "step": 0, "layout": layout, "config": dataclasses.asdict(run),
        "model": dataclasses.asdict(cfg), "data": data, "sampler": {"next_step": 0},
        "scaler": {}, "reducer": {"step": 0}, "optimizer": {"kind": "none", "step": 0},
        "tensors": entries, "files": {fname: info},
        "ranks": {"0": {"coord": [0, 0, 0], "file": fname, "own": []}},
        "source": {"hf_dir": os.path.abspath(hf_dir), "architectures": c.get("architectures")}})
    promote(tmp, final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.import_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="Hugging Face model directory (save_pretrained)")
    parser.add_argument("--save", required=True, help="gridtron checkpoint directory to write")
    args = parser.parse_args(argv)
    try:
        ckpt = import_hf(args.load, args.save)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"gridtron: import error: {exc}", file=sys.stderr)
        return 1
    with open(os.path.join(ckpt, INDEX_NAME), encoding="utf-8") as fh:
        m = json.load(fh)["model"]
    print(f"wrote {ckpt}: {m['block']}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
          f"{m['num_attention_heads']} heads, vocab {m['vocab_size']}\n"
          f"continue pretraining with: python -m engine.train --load {args.save} --use-checkpoint-args "
          f"--data-path PREFIX ... (data prepared with --tokenizer-model {args.load})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
