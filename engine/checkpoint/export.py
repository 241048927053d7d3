"""``python -m engine.export --load DIR --to hf --out DIR2``: a Hugging Face transformers model.

gpt2 blocks become ``GPT2LMHeadModel``, llama blocks ``LlamaForCausalLM``; the output directory
holds ``config.json`` and ``model.safetensors`` (plus ``tokenizer.json`` and ``tokenizer_config.json``
with the eos/bos tokens when the checkpoint has a tokenizer), loadable with
``AutoModelForCausalLM.from_pretrained(DIR2)`` and ``AutoTokenizer.from_pretrained(DIR2)``; every
file is world-readable. The full logical
tensors are read from the checkpoint whatever layout saved them; vocabulary padding is never stored.

Weight mapping. Our fused QKV weight is (3h, h) with rows ordered (head, q|k|v, head_dim), so whole
heads stay together under TP. GPT-2's ``c_attn`` is a Conv1D holding (in, out) = (h, 3h) with the
columns q | k | v, each head-major; Llama's q/k/v projections are separate (out, in) Linears. All
Linear-style weights are transposed for GPT-2's Conv1D. Rotary embeddings need no permutation:
our kernels use the same rotate-half convention as Hugging Face Llama.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file


from engine.checkpoint.index import CheckpointError, TensorReader, intact_hint, read_index, resolve, verify


def _split_qkv(w: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """(3h, ...) rows ordered (head, q|k|v, head_dim) -> q, k, v each (h, ...) head-major."""
    parts = w.view(heads, 3, -1, *w.shape[1:])  # (n, 3, d, ...)
    return tuple(parts[:, i].reshape(-1, *w.shape[1:]) for i in range(3))


def _gpt2(get, m: dict, eot: int | None) -> tuple[dict, dict]:
    n = m["num_attention_heads"]
    sd = {"transformer.wte.weight": get("embedding.word.weight"),
          "transformer.wpe.weight": get("embedding.position"),
          "transformer.ln_f.weight": get("final_norm.weight"),
          "transformer.ln_f.bias": get("final_norm.bias")}
    for i in range(m["num_layers"]):
        src, dst = f"layers.{i}", f"transformer.h.{i}"
        sd[f"{dst}.attn.c_attn.weight"] = torch.cat(_split_qkv(get(f"{src}.attn.qkv.weight"), n)).t()
        sd[f"{dst}.attn.c_attn.bias"] = torch.cat(_split_qkv(get(f"{src}.attn.qkv.bias"), n))
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            sd[f"{dst}.{theirs}.weight"] = get(f"{src}.{ours}.weight").t()  # Conv1D: (in, out)
            sd[f"{dst}.{theirs}.bias"] = get(f"{src}.{ours}.bias")
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            sd[f"{dst}.{theirs}.weight"] = get(f"{src}.{ours}.weight")
            sd[f"{dst}.{theirs}.bias"] = get(f"{src}.{ours}.bias")
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": m["vocab_size"], "n_positions": m["max_position_embeddings"],
              "n_embd": m["hidden_size"], "n_layer": m["num_layers"], "n_head": n,
              "n_inner": m["ffn_hidden_size"], "activation_function": "gelu_new",
              "layer_norm_epsilon": m["norm_eps"], "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0, "scale_attn_weights": True, "tie_word_embeddings": True,
              "bos_token_id": eot, "eos_token_id": eot}
    return sd, config


def _llama(get, m: dict, eot: int | None) -> tuple[dict, dict]:
    n = m["num_attention_heads"]
    sd = {"model.embed_tokens.weight": get("embedding.word.weight"),
          "model.norm.weight": get("final_norm.weight"), "lm_head.weight": get("output.weight")}
    for i in range(m["num_layers"]):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        q, k, v = _split_qkv(get(f"{src}.attn.qkv.weight"), n)
        sd.update({f"{dst}.self_attn.q_proj.weight": q, f"{dst}.self_attn.k_proj.weight": k,
                   f"{dst}.self_attn.v_proj.weight": v,
                   f"{dst}.self_attn.o_proj.weight": get(f"{src}.attn.proj.weight"),
                   f"{dst}.mlp.gate_proj.weight": get(f"{src}.mlp.gate.weight"),
                   f"{dst}.mlp.up_proj.weight": get(f"{src}.mlp.up.weight"),
                   f"{dst}.mlp.down_proj.weight": get(f"{src}.mlp.fc2.weight"),
                   f"{dst}.input_layernorm.weight": get(f"{src}.norm1.weight"),
                   f"{dst}.post_attention_layernorm.weight": get(f"{src}.norm2.weight")})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"],
              "intermediate_size": m["ffn_hidden_size"], "num_hidden_layers": m["num_layers"],
              "num_attention_heads": n, "num_key_value_heads": n,
              "head_dim": m["hidden_size"] // n, "max_position_embeddings": m["max_position_embeddings"],
              "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_base"],
              "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_base"]},
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False, "attention_dropout": 0.0,
              "bos_token_id": eot, "eos_token_id": eot}
    return sd, config


EXPORTERS = {"gpt2": _gpt2, "llama": _llama}


def export_hf(path: str, out: str) -> dict:
    """Write ``out/config.json`` and ``out/model.safetensors``; return the config."""
    ckpt = resolve(path)
    index = read_index(ckpt)
    problems = verify(ckpt, index)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems)
                              + intact_hint(os.path.dirname(ckpt), exclude=ckpt))
    m = index["model"]
    if m["block"] not in EXPORTERS:
        raise CheckpointError(f"--to hf knows the gpt2 and llama blocks, not {m['block']!r}")
    reader = TensorReader(ckpt, index)

    def get(name: str) -> torch.Tensor:
        shape = index["tensors"][f"model/{name}"]["shape"]
        return reader.read(f"model/{name}", [0] * len(shape), shape)

    eot = index["data"].get("eot_id") if index["data"]["tokenizer"] else None
    sd, config = EXPORTERS[m["block"]](get, m, eot)
    config.update({"dtype": "float32", "torch_dtype": "float32"})
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    if os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
            if os.path.isfile(os.path.join(ckpt, name)):
                shutil.copyfile(os.path.join(ckpt, name), os.path.join(out, name))
        _tokenizer_config(ckpt, out, eot, m["max_position_embeddings"])
    os.chmod(out, 0o755)
    for name in os.listdir(out):  # world-readable, whatever the umask of the saving job
        os.chmod(os.path.join(out, name), 0o644)
    return config


def _tokenizer_config(ckpt: str, out: str, eot: int | None, max_length: int) -> None:
    """tokenizer_config.json: the checkpoint's own (an imported model's), else eos/bos from the
    end-of-text token, so transformers' AutoTokenizer knows where text ends."""
    own = os.path.join(ckpt, "tokenizer_config.json")
    if os.path.isfile(own):
        shutil.copyfile(own, os.path.join(out, "tokenizer_config.json"))
        return
    from tokenizers import Tokenizer
    text = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json")).id_to_token(eot) if eot is not None else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "eos_token": text, "bos_token": text, "clean_up_tokenization_spaces": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (or its --save root)")
    parser.add_argument("--to", choices=["hf"], default="hf")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        config = export_hf(args.load, args.out)
    except CheckpointError as exc:
        print(f"gridtron: checkpoint error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {config['architectures'][0]} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
