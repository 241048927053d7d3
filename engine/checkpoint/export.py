"""``python -m engine.export --load DIR --to hf --out DIR2``: a Hugging Face transformers model.

gpt2 blocks become ``GPT2LMHeadModel``; llama blocks ``LlamaForCausalLM``, with ``--qk-layernorm``
``Qwen3ForCausalLM``, with experts ``MixtralForCausalLM`` (every layer MoE, the default router) or,
with ``--qk-layernorm``, ``Qwen3MoeForCausalLM`` (engine/checkpoint/hf_moe.py: the routers and
experts, and the MoE models no transformers class holds, which are refused); the output directory
holds ``config.json`` and ``model.safetensors`` (plus, when the checkpoint has a tokenizer,
``tokenizer.json``, ``tokenizer_config.json`` and the checkpoint's chat template and
``generation_config.json``; config.json's bos/eos/pad ids: ``special_ids``), loadable with
``AutoModelForCausalLM.from_pretrained(DIR2)`` and ``AutoTokenizer.from_pretrained(DIR2)``; every
file is world-readable. ``--out`` must be new or empty unless ``--overwrite``. The full logical
tensors are read from the checkpoint whatever layout saved them; vocabulary padding is never stored.
``--dtype`` is the exported weights' dtype (``torch_dtype`` in config.json): by default the one the
checkpoint's weights were saved in (a bf16 run's bf16, bit for bit), or fp32, bf16 or fp16.

Weight mapping. Our fused QKV weight is ((n + 2G) d, h) for n heads of size d in G key/value groups,
rows ordered (group, [the n/G query heads of the group | k | v], head_dim), so whole groups stay
together under TP; G = n is (head, q|k|v, head_dim). Llama's q/k/v projections are separate
(out, in) Linears, q (n d, h) head-major and k, v (G d, h) group-major, and HF's ``repeat_kv`` gives
query head i the key/value head i // (n/G), our grouping; ``num_key_value_heads`` = G. GPT-2's
``c_attn`` is a Conv1D holding (in, out) = (h, 3h) with the columns q | k | v, each head-major; it
has no grouped-query attention, so with G < n each key/value head is written once per query head
of its group (the same function, as multi-head attention). All Linear-style weights are transposed
for GPT-2's Conv1D. Rotary embeddings need no permutation: our kernels use the same rotate-half
convention as Hugging Face Llama.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from engine.base import ConfigError, ToolParser, os_error_text, run_tool, unwritable
from engine.checkpoint.index import (CheckpointError, intact_hint, read_index, resolve, verify,
                                     is_weight_key)
from engine.checkpoint.tensor_reader import TensorReader
from engine.checkpoint.hf_moe import export_family, export_moe_config, export_moe_layer
from engine.config.schema import PRECISION_DTYPES as DTYPES


def split_qkv(w: torch.Tensor, heads: int, groups: int | None = None) -> tuple[torch.Tensor, ...]:
    """((n + 2G) d, ...) rows ordered (group, [q heads | k | v], head_dim) -> q (n d, ...) head-major,
    k and v (G d, ...) group-major. The inverse is ``fuse_qkv``."""
    g = heads if groups is None else groups
    r = heads // g  # query heads per group
    parts = w.view(g, r + 2, -1, *w.shape[1:])  # (G, n/G + 2, d, ...)
    rest = w.shape[1:]
    return (parts[:, :r].reshape(-1, *rest), parts[:, r].reshape(-1, *rest),
            parts[:, r + 1].reshape(-1, *rest))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             groups: int) -> torch.Tensor:
    """HF-style q (n d, ...), k and v (G d, ...) -> our fused ((n + 2G) d, ...) weight (or bias)."""
    r, rest = heads // groups, q.shape[1:]
    parts = (q.reshape(groups, r, -1, *rest), k.reshape(groups, 1, -1, *rest),
             v.reshape(groups, 1, -1, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)  # (G, n/G + 2, d, ...) flattened


def _mha_qkv(w: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """q | k | v with every key/value head repeated for each query head of its group: (3h, ...)."""
    q, k, v = split_qkv(w, heads, groups)
    r = heads // groups
    k, v = (t.view(groups, -1, *t.shape[1:]).repeat_interleave(r, 0).reshape(-1, *t.shape[1:])
            for t in (k, v))
    return torch.cat((q, k, v))


def _gpt2(get, m: dict, eot: int | None) -> tuple[dict, dict]:
    if m.get("num_experts") is not None or m.get("qk_layernorm"):
        raise CheckpointError("--to hf: GPT2LMHeadModel has no mixture of experts and no "
                              "--qk-layernorm; this gpt2-block model cannot be exported")
    n = m["num_attention_heads"]
    g = m.get("num_query_groups") or n
    sd = {"transformer.wte.weight": get("embedding.word.weight"),
          "transformer.wpe.weight": get("embedding.position"),
          "transformer.ln_f.weight": get("final_norm.weight"),
          "transformer.ln_f.bias": get("final_norm.bias")}
    for i in range(m["num_layers"]):
        src, dst = f"layers.{i}", f"transformer.h.{i}"
        sd[f"{dst}.attn.c_attn.weight"] = _mha_qkv(get(f"{src}.attn.qkv.weight"), n, g).t()
        sd[f"{dst}.attn.c_attn.bias"] = _mha_qkv(get(f"{src}.attn.qkv.bias"), n, g)
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


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _llama(get, m: dict, eot: int | None) -> tuple[dict, dict]:
    family = export_family(m)
    n = m["num_attention_heads"]
    g = m.get("num_query_groups") or n
    qk = m.get("qk_layernorm", False)
    if m.get("num_experts") is not None:
        from models.moe.config import moe_layer_pattern
        moe = moe_layer_pattern(m["moe_layer_freq"], m["num_layers"])
    else:
        moe = [False] * m["num_layers"]
    sd = {"model.embed_tokens.weight": get("embedding.word.weight"),
          "model.norm.weight": get("final_norm.weight"), "lm_head.weight": get("output.weight")}
    for i in range(m["num_layers"]):
        src, dst = f"layers.{i}", f"model.layers.{i}"
        q, k, v = split_qkv(get(f"{src}.attn.qkv.weight"), n, g)
        sd.update({f"{dst}.self_attn.q_proj.weight": q, f"{dst}.self_attn.k_proj.weight": k,
                   f"{dst}.self_attn.v_proj.weight": v,
                   f"{dst}.self_attn.o_proj.weight": get(f"{src}.attn.proj.weight"),
                   f"{dst}.input_layernorm.weight": get(f"{src}.norm1.weight"),
                   f"{dst}.post_attention_layernorm.weight": get(f"{src}.norm2.weight")})
        if qk:
            sd.update({f"{dst}.self_attn.q_norm.weight": get(f"{src}.attn.q_norm.weight"),
                       f"{dst}.self_attn.k_norm.weight": get(f"{src}.attn.k_norm.weight")})
        if moe[i]:
            sd.update(export_moe_layer(get, src, dst, m, family == "mixtral"))
        else:
            sd.update({f"{dst}.mlp.gate_proj.weight": get(f"{src}.mlp.gate.weight"),
                       f"{dst}.mlp.up_proj.weight": get(f"{src}.mlp.up.weight"),
                       f"{dst}.mlp.down_proj.weight": get(f"{src}.mlp.fc2.weight")})
    config = {"architectures": [ARCHITECTURES[family]], "model_type": family,
              "vocab_size": m["vocab_size"], "hidden_size": m["hidden_size"],
              "intermediate_size": m["ffn_hidden_size"], "num_hidden_layers": m["num_layers"],
              "num_attention_heads": n, "num_key_value_heads": g,
              "head_dim": m["hidden_size"] // n, "max_position_embeddings": m["max_position_embeddings"],
              "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_base"],
              "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_base"]},
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False, "attention_dropout": 0.0,
              "bos_token_id": eot, "eos_token_id": eot}
    if family in ("qwen3", "qwen3_moe"):
        config.update({"use_sliding_window": False, "sliding_window": None})
    if family in ("mixtral", "qwen3_moe"):
        config.update(export_moe_config(m, family))
    return sd, config


EXPORTERS = {"gpt2": _gpt2, "llama": _llama}


COPIED = ("tokenizer.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
          "chat_template.json")  # the checkpoint's tokenizer files, copied as they are
EXPORTED = ("config.json", "model.safetensors", "tokenizer_config.json", *COPIED)  # all export writes


def check_out_dir(flag: str, path: str, overwrite: bool) -> None:
    """``path`` can be a tool's output directory: a directory (or none yet) that can be written and,
    unless ``overwrite``, is empty. ConfigError naming ``flag`` otherwise; creates nothing."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file: give a directory")
    if (problem := unwritable(path)):
        raise ConfigError(f"{flag} {path}: {problem}; choose a directory you can write to")
    held = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"{flag} {path} is not empty (it holds {shown}): choose a new directory, "
                          f"or add --overwrite to replace what is there")


def saved_dtype(index: dict) -> torch.dtype:
    """The dtype most of the checkpoint's model weights were saved in (elements counted; fp32 when
    it is not a floating dtype export writes)."""
    counts: dict[str, int] = {}
    for name, entry in index["tensors"].items():
        if name.startswith("model/"):
            n = 1
            for d in entry["shape"]:
                n *= d
            counts[entry["dtype"]] = counts.get(entry["dtype"], 0) + n
    name = max(counts, key=counts.get) if counts else "float32"
    return {str(t)[6:]: t for t in DTYPES.values()}.get(name, torch.float32)


def export_hf(path: str, out: str, overwrite: bool = False, dtype: torch.dtype | None = None) -> dict:
    """Write ``out/config.json`` and ``out/model.safetensors`` (and the tokenizer files); return the
    config. Everything is read and checked before anything is written; ``out`` must be empty
    unless ``overwrite`` (then the files of an earlier export there are replaced)."""
    ckpt = resolve(path)
    index = read_index(ckpt)
    root = os.path.realpath(os.path.dirname(ckpt))
    if os.path.realpath(out) in (os.path.realpath(ckpt), root):
        raise ConfigError(f"--out {out} is the checkpoint's own directory: give the export a "
                          f"directory of its own")
    check_out_dir("--out", out, overwrite)
    problems = verify(ckpt, index, keys=is_weight_key)   # (the optimizer state is not read)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems)
                              + intact_hint(os.path.dirname(ckpt), exclude=ckpt))
    m = index["model"]
    if m["block"] not in EXPORTERS:
        raise CheckpointError(f"--to hf knows the gpt2 and llama blocks, not {m['block']!r}")
    reader = TensorReader(ckpt, index)

    def get(name: str) -> torch.Tensor:
        if f"model/{name}" not in index["tensors"]:
            raise CheckpointError(f"checkpoint {ckpt} has no tensor {name}: it is not a whole "
                                  f"{m['block']} model")
        shape = index["tensors"][f"model/{name}"]["shape"]
        return reader.read(f"model/{name}", [0] * len(shape), shape)

    eot = index["data"].get("eot_id") if index["data"]["tokenizer"] else None
    sd, config = EXPORTERS[m["block"]](get, m, eot)
    dtype = saved_dtype(index) if dtype is None else dtype
    sd = {k: v.to(dtype) for k, v in sd.items()}     # (read as fp32: exact for what was saved)
    config.update({"dtype": str(dtype)[6:], "torch_dtype": str(dtype)[6:]})
    tokenizer = _read_tokenizer(ckpt)
    if tokenizer is not None:
        config.update(special_ids(ckpt, tokenizer, eot))
    os.makedirs(out, exist_ok=True)
    for name in EXPORTED:  # --overwrite: no file of an earlier export outlives this one
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    if tokenizer is not None:
        for name in COPIED:
            if os.path.isfile(os.path.join(ckpt, name)):
                shutil.copyfile(os.path.join(ckpt, name), os.path.join(out, name))
        _tokenizer_config(ckpt, out, tokenizer, config, m["max_position_embeddings"])
    os.chmod(out, 0o755)
    for name in EXPORTED:  # world-readable, whatever the umask of the saving job
        if os.path.isfile(os.path.join(out, name)):
            os.chmod(os.path.join(out, name), 0o644)
    return config


def _read_tokenizer(ckpt: str):
    """The checkpoint's tokenizer.json as a ``tokenizers.Tokenizer`` (None without one); read before
    anything is written, so a damaged one stops the export first."""
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise CheckpointError(f"{path} cannot be read as a tokenizer ({exc})") from exc


def _json(path: str) -> dict:
    """A JSON object file of the checkpoint's tokenizer ({} when there is none)."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): repair or remove it") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object: repair or "
                              f"remove it")
    return value


def prepended_bos(tok) -> int | None:
    """The id the tokenizer's post-processor puts before every text, or None when it adds none."""
    plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
    return full[0] if len(full) > len(plain) and full[1:len(plain) + 1] == plain else None


def special_ids(ckpt: str, tok, eot: int | None) -> dict:
    """bos/eos/pad_token_id for config.json: those of the checkpoint's generation_config.json, else
    the tokens its tokenizer_config.json (or special_tokens_map.json) names; failing both, BOS is
    the token the tokenizer puts before every text (the end-of-text token when it puts none) and
    EOS the end-of-text token."""
    bos = prepended_bos(tok)
    ids = {"bos_token_id": eot if bos is None else bos, "eos_token_id": eot}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later one wins
        named = _json(os.path.join(ckpt, name))
        for key in ("bos_token", "eos_token", "pad_token"):
            text = named.get(key)
            text = text.get("content") if isinstance(text, dict) else text  # {"content": ...} or text
            if isinstance(text, str) and tok.token_to_id(text) is not None:
                ids[f"{key}_id"] = tok.token_to_id(text)
    generation = _json(os.path.join(ckpt, "generation_config.json"))
    ids.update({k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if generation.get(k) is not None})
    return ids


def _tokenizer_config(ckpt: str, out: str, tok, config: dict, max_length: int) -> None:
    """tokenizer_config.json: the checkpoint's own (an imported model's), else the bos, eos and pad
    tokens of ``config`` (config.json), so transformers' AutoTokenizer knows where text starts and
    ends."""
    own = os.path.join(ckpt, "tokenizer_config.json")
    if os.path.isfile(own):
        shutil.copyfile(own, os.path.join(out, "tokenizer_config.json"))
        return

    def text(key: str) -> str | None:
        i = config.get(f"{key}_id")
        i = i[0] if isinstance(i, list) and i else i   # generation_config's eos may be a list
        return tok.id_to_token(i) if isinstance(i, int) else None

    tokens = {"eos_token": text("eos_token"), "bos_token": text("bos_token")}
    if text("pad_token") is not None:
        tokens["pad_token"] = text("pad_token")
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                   **tokens, "clean_up_tokenization_spaces": False}, fh, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m engine.export", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (or its --save root)")
    parser.add_argument("--to", choices=["hf"], default="hf")
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier export in a non-empty --out")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="the exported weights' dtype (auto: the one the checkpoint saved them in)")
    parsed = {}

    def body() -> int:
        args = parsed["args"] = parser.parse_args(argv)
        config = export_hf(args.load, args.out, args.overwrite,
                           None if args.dtype == "auto" else DTYPES[args.dtype])
        print(f"wrote {config['architectures'][0]} ({config['torch_dtype']}) to {args.out}")
        return 0

    return run_tool(body, (CheckpointError, lambda e: f"checkpoint error: {e}", 2),
                    (OSError, lambda e: f"cannot write {os_error_text(e, parsed['args'].out)}", 1))


if __name__ == "__main__":
    sys.exit(main())
