"""``python -m engine.import_hf --load HF_DIR --save CKPT_DIR``: a Hugging Face transformers GPT-2,
Llama, Qwen3, Mixtral or Qwen3-MoE checkpoint (safetensors) becomes a gridtron checkpoint, the
mirror of ``engine.export``.

The model configuration is read from ``config.json``; the weights from ``model.safetensors`` (or
the shards listed by ``model.safetensors.index.json``); the tokenizer files are copied, with the
chat template (``chat_template.jinja`` or the older ``chat_template.json``) and
``generation_config.json``. The result is a checkpoint of step 0 holding the full logical
tensors, so it loads under any layout (``--load CKPT_DIR --use-checkpoint-args``) and continued
pretraining starts from these weights with a fresh optimizer. The weight mapping is export.py's,
inverted: GPT-2's Conv1D weights are (in, out) and transposed; the q, k and v projections are
interleaved per key/value group into our fused QKV rows (group, [the group's query heads | k | v],
head_dim), so whole groups stay together under TP; with grouped-query attention
(``num_key_value_heads`` G < ``num_attention_heads``) G is ``--num-query-groups``. Rotary
embeddings need no permutation (both sides rotate halves). Qwen3 and Qwen3-MoE are llama blocks
with ``--qk-layernorm`` (``self_attn.q_norm`` / ``k_norm``); Mixtral and Qwen3-MoE's experts and
routers are mapped by engine/checkpoint/hf_moe.py.

Everything is read and checked first (config.json, the tokenizer, every weight against the shape our
model needs, built on the meta device), before anything is written; ``--save`` must be new or empty
unless ``--overwrite`` (then the import replaces the checkpoints there).
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

from engine.base import ConfigError, ToolParser, os_error_text, run_tool
from engine.checkpoint.index import (ASIDE, FORMAT, INDEX_NAME, CheckpointError, sha256_file,
                                     step_dir_name, write_json, write_shard)
from engine.checkpoint.export import check_out_dir, fuse_qkv
from engine.checkpoint.hf_moe import import_moe_layer, mixtral_fields, qwen3_moe_fields
from engine.checkpoint.writer import promote
from models.config import GPTConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def read_config(hf_dir: str) -> dict:
    """``hf_dir/config.json`` as a dict; a missing directory or file, or one that is not a JSON
    object, is a CheckpointError naming it."""
    if not os.path.isdir(hf_dir):
        what = "does not exist" if not os.path.exists(hf_dir) else "is a file"
        raise CheckpointError(f"--load {hf_dir} {what}: pass the directory transformers' "
                              f"save_pretrained wrote")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} has no config.json: pass a directory written by transformers' "
                              f"save_pretrained")
    try:
        with open(path, encoding="utf-8") as fh:
            c = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): restore it from the model's "
                              f"source") from exc
    if not isinstance(c, dict):
        raise CheckpointError(f"{path} holds a JSON {type(c).__name__}, not the object of a model "
                              f"configuration")
    return c


def _safetensors_files(hf_dir: str) -> list[str]:
    single = os.path.join(hf_dir, "model.safetensors")
    sharded = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(sharded):
        try:
            with open(sharded, encoding="utf-8") as fh:
                names = set(json.load(fh)["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{sharded} is not a safetensors index (a JSON object with a "
                                  f"'weight_map'): {exc}") from exc
        files = sorted(os.path.join(hf_dir, str(f)) for f in names)
        if (missing := [f for f in files if not os.path.isfile(f)]):
            raise CheckpointError(f"{sharded} names {missing[0]}, which is missing")
        return files
    if any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("pytorch_model.bin", "model.bin")):
        raise CheckpointError(f"{hf_dir} holds pickled PyTorch weights; this importer reads safetensors "
                              f"only: re-save with model.save_pretrained(DIR) (safetensors by default)")
    raise CheckpointError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in _safetensors_files(hf_dir):
        try:
            with safe_open(f, framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{f} is not a readable safetensors file ({exc}): it may be "
                                  f"truncated; download or save it again") from exc
    return out


def _require(cond: bool, what: str, hf_dir: str) -> None:
    if not cond:
        raise CheckpointError(f"{hf_dir}: {what}")


def _count(c: dict, key: str, hf_dir: str, default=None) -> int:
    """A positive integer field of config.json."""
    value = c.get(key, default)
    if type(value) is not int or value < 1:
        what = "is missing" if key not in c else f"is {value!r}, not a positive integer"
        raise CheckpointError(f"{hf_dir}/config.json: {key} {what}")
    return value


def _number(c: dict, key: str, hf_dir: str, default: float) -> float:
    value = c.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"{hf_dir}/config.json: {key} is {value!r}, not a positive number")
    return float(value)


def _gpt2_config(c: dict, hf_dir: str) -> GPTConfig:
    act = c.get("activation_function", "gelu_new")
    _require(act in ("gelu_new", "gelu_pytorch_tanh"), f"activation {act!r} is not supported (our "
             f"GPT-2 block uses the tanh GELU, gelu_new)", hf_dir)
    _require(not c.get("scale_attn_by_inverse_layer_idx") and not c.get("reorder_and_upcast_attn"),
             "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported", hf_dir)
    _require(c.get("scale_attn_weights", True), "scale_attn_weights=false is not supported", hf_dir)
    _require(c.get("tie_word_embeddings", True), "an untied GPT-2 output layer is not supported", hf_dir)
    h, n, layers = (_count(c, k, hf_dir) for k in ("n_embd", "n_head", "n_layer"))
    positions = _count(c, "n_positions", hf_dir)
    ffn = 4 * h if c.get("n_inner") is None else _count(c, "n_inner", hf_dir)
    return GPTConfig(num_layers=layers, hidden_size=h, num_attention_heads=n, ffn_hidden_size=ffn,
                     seq_length=positions, max_position_embeddings=positions,
                     vocab_size=_count(c, "vocab_size", hf_dir), block="gpt2",
                     norm_eps=_number(c, "layer_norm_epsilon", hf_dir, 1e-5))


def _gpt2_weights(cfg: GPTConfig, c: dict, w: dict) -> dict:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    w = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in w.items()}
    sd = {"embedding.word.weight": w["wte.weight"], "embedding.position": w["wpe.weight"],
          "final_norm.weight": w["ln_f.weight"], "final_norm.bias": w["ln_f.bias"]}
    for i in range(cfg.num_layers):
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
    return sd


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if kind not in ("default", None):
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _llama_config(c: dict, hf_dir: str, **extra) -> GPTConfig:
    """Llama and the families built like it (``extra``: their GPTConfig fields on top)."""
    h, n, layers = (_count(c, k, hf_dir) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
    kv = _count(c, "num_key_value_heads", hf_dir, n) if c.get("num_key_value_heads") is not None else n
    _require(n % kv == 0, f"num_key_value_heads {kv} does not divide num_attention_heads {n}", hf_dir)
    _require(c.get("head_dim") in (None, h // n), f"head_dim {c.get('head_dim')} != hidden_size / "
             f"num_attention_heads = {h // n} is not supported", hf_dir)
    _require(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.get('hidden_act')!r} is not "
             f"supported (SwiGLU uses silu)", hf_dir)
    _require(not c.get("attention_bias") and not c.get("mlp_bias"), "attention or MLP biases are not "
             "supported by the llama block", hf_dir)
    positions = _count(c, "max_position_embeddings", hf_dir)
    window = c.get("sliding_window")
    _require(window is None or not c.get("use_sliding_window", True) or window >= positions,
             f"sliding_window {window} (attention over a window shorter than max_position_embeddings "
             f"{positions}) is not supported", hf_dir)
    try:
        theta = _rope_theta(c)
    except (ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{hf_dir}: {exc}") from exc
    return GPTConfig(num_layers=layers, hidden_size=h, num_attention_heads=n, num_query_groups=kv,
                     ffn_hidden_size=_count(c, "intermediate_size", hf_dir), seq_length=positions,
                     max_position_embeddings=positions, vocab_size=_count(c, "vocab_size", hf_dir),
                     block="llama", norm_eps=_number(c, "rms_norm_eps", hf_dir, 1e-6), rope_base=theta,
                     **extra)


def _qwen3_config(c: dict, hf_dir: str) -> GPTConfig:
    return _llama_config(c, hf_dir, qk_layernorm=True)


def _mixtral_config(c: dict, hf_dir: str) -> GPTConfig:
    return _llama_config(c, hf_dir, **mixtral_fields(c, hf_dir, _count))


def _qwen3_moe_config(c: dict, hf_dir: str) -> GPTConfig:
    layers = _count(c, "num_hidden_layers", hf_dir)
    return _llama_config(c, hf_dir, qk_layernorm=True, **qwen3_moe_fields(c, hf_dir, layers, _count))


def _llama_weights(cfg: GPTConfig, c: dict, w: dict) -> dict:
    n, kv = cfg.num_attention_heads, cfg.num_query_groups
    embed = w["model.embed_tokens.weight"]
    out = w.get("lm_head.weight")
    if out is None:
        if not c.get("tie_word_embeddings", False):
            raise KeyError("lm_head.weight")
        out = embed.clone()  # our llama block keeps an untied output layer: start it equal
    sd = {"embedding.word.weight": embed, "final_norm.weight": w["model.norm.weight"],
          "output.weight": out}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        a = f"{src}.self_attn"
        sd[f"{dst}.attn.qkv.weight"] = fuse_qkv(w[f"{a}.q_proj.weight"], w[f"{a}.k_proj.weight"],
                                                w[f"{a}.v_proj.weight"], n, kv)
        if cfg.qk_layernorm:
            sd.update({f"{dst}.attn.q_norm.weight": w[f"{a}.q_norm.weight"],
                       f"{dst}.attn.k_norm.weight": w[f"{a}.k_norm.weight"]})
        if cfg.is_moe_layer(i):
            sd.update(import_moe_layer(w, src, dst, cfg.num_experts, c["model_type"] == "mixtral"))
        else:
            sd.update({f"{dst}.mlp.gate.weight": w[f"{src}.mlp.gate_proj.weight"],
                       f"{dst}.mlp.up.weight": w[f"{src}.mlp.up_proj.weight"],
                       f"{dst}.mlp.fc2.weight": w[f"{src}.mlp.down_proj.weight"]})
        sd.update({f"{dst}.attn.proj.weight": w[f"{a}.o_proj.weight"],
                   f"{dst}.norm1.weight": w[f"{src}.input_layernorm.weight"],
                   f"{dst}.norm2.weight": w[f"{src}.post_attention_layernorm.weight"]})
    return sd


IMPORTERS = {"gpt2": (_gpt2_config, _gpt2_weights), "llama": (_llama_config, _llama_weights),
             "qwen3": (_qwen3_config, _llama_weights), "mixtral": (_mixtral_config, _llama_weights),
             "qwen3_moe": (_qwen3_moe_config, _llama_weights)}


def model_config(hf_dir: str) -> tuple[GPTConfig, dict]:
    """Our model configuration for the transformers model in ``hf_dir``, and its config.json."""
    c = read_config(hf_dir)
    kind = c.get("model_type")
    if kind not in IMPORTERS:
        raise CheckpointError(f"{hf_dir}: model_type {kind!r} is not supported; "
                              f"{', '.join(IMPORTERS)} are")
    try:
        return IMPORTERS[kind][0](c, hf_dir), c
    except ValueError as exc:  # GPTConfig's own checks (e.g. heads that do not divide the width)
        raise CheckpointError(f"{hf_dir}/config.json: {exc}") from exc


def expected_shapes(cfg: GPTConfig) -> dict[str, list[int]]:
    """Every logical tensor of our model for ``cfg`` and its shape, from the model itself built on
    the meta device (nothing is allocated)."""
    from models import LayerContext
    from models.gpt import GPTChunk
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    from engine.checkpoint.specs import param_specs
    with torch.device("meta"):
        ps = ParallelState.serial("meta")
        chunk = GPTChunk(cfg, ps, LayerContext(Initializer(cfg.seed, cfg.init_std)), range(cfg.num_layers))
    return {s.name: s.global_shape for s in param_specs([chunk], ps, cfg.vocab_size)}


def map_weights(cfg: GPTConfig, c: dict, hf_dir: str) -> dict[str, torch.Tensor]:
    """The weights of ``hf_dir`` under our names, each checked against the shape ``cfg`` needs."""
    w = read_hf_weights(hf_dir)
    try:
        sd = IMPORTERS[c["model_type"]][1](cfg, c, w)
    except KeyError as exc:
        raise CheckpointError(f"{hf_dir}: weight {exc} is missing from the safetensors files") from exc
    except RuntimeError as exc:  # a split or view that the stored shapes do not allow
        raise CheckpointError(f"{hf_dir}: the weights do not fit config.json ({exc}); is config.json "
                              f"from another model?") from exc
    for name, shape in expected_shapes(cfg).items():
        if name not in sd:
            raise CheckpointError(f"{hf_dir}: no weight maps onto our {name}")
        if list(sd[name].shape) != shape:
            raise CheckpointError(f"{hf_dir}: the weights do not fit config.json: our {name} would be "
                                  f"{list(sd[name].shape)} but config.json's model needs {shape}; is "
                                  f"config.json from another model?")
    return sd


def _tokenizer_facts(hf_dir: str) -> dict:
    from engine.data.hf_tokenizer import load_hf_tokenizer
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return {"tokenizer": None, "eot_id": None, "tokenizer_sha256": None}
    try:
        tok = load_hf_tokenizer(hf_dir)
    except Exception as exc:  # noqa: BLE001 - tokenizers and transformers raise their own types
        raise CheckpointError(f"{path} cannot be read as a tokenizer ({exc}); restore it from the "
                              f"model's source") from exc
    return {"tokenizer": "hf", "eot_id": tok.eot_id, "tokenizer_sha256": sha256_file(path)}


def check_save(save: str, hf_dir: str, overwrite: bool) -> None:
    """``--save`` is a directory this import may write: not the model's own directory, and empty
    unless ``overwrite`` (ConfigError otherwise)."""
    if os.path.exists(save) and os.path.realpath(save) == os.path.realpath(hf_dir):
        raise ConfigError(f"--save {save} is the --load directory itself: give the gridtron "
                          f"checkpoint a directory of its own")
    check_out_dir("--save", save, overwrite)


def import_hf(hf_dir: str, save: str, overwrite: bool = False) -> str:
    """Write ``save/iter_0000000`` (and ``save/latest``); return the checkpoint directory. Every
    input is read and checked before anything is written; ``save`` must be empty unless
    ``overwrite``, and then the import replaces the checkpoints there (removed once it is
    written)."""
    from engine.config.schema import CompressionConfig, RunConfig
    cfg, c = model_config(hf_dir)
    check_save(save, hf_dir, overwrite)
    facts = _tokenizer_facts(hf_dir)
    sd = map_weights(cfg, c, hf_dir)
    final = os.path.join(save, step_dir_name(0))
    tmp = final + ".tmp"
    created = not os.path.exists(save)
    try:
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
                **facts}
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
    except BaseException:
        shutil.rmtree(save if created else tmp, ignore_errors=True)  # leave nothing half-written
        raise
    promote(tmp, final)
    for name in os.listdir(save):  # --overwrite: the checkpoints the import replaces
        if name == ASIDE or (name.startswith("iter_") and name != os.path.basename(final)):
            shutil.rmtree(os.path.join(save, name), ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog="python -m engine.import_hf", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="Hugging Face model directory (save_pretrained)")
    parser.add_argument("--save", required=True, help="gridtron checkpoint directory to write (new or "
                                                      "empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let the import replace the checkpoints in a non-empty --save")
    parsed = {}

    def body() -> int:
        args = parsed["args"] = parser.parse_args(argv)
        ckpt = import_hf(args.load, args.save, args.overwrite)
        with open(os.path.join(ckpt, INDEX_NAME), encoding="utf-8") as fh:
            m = json.load(fh)["model"]
        extra = "".join((
            f", {m['num_query_groups']} key/value groups"
            if m["num_query_groups"] != m["num_attention_heads"] else "",
            ", qk-layernorm" if m.get("qk_layernorm") else "",
            f", {m['num_experts']} experts (top-{m['moe_router_topk']})" if m.get("num_experts") else ""))
        print(f"wrote {ckpt}: {m['block']}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
              f"{m['num_attention_heads']} heads{extra}, vocab {m['vocab_size']}\n"
              f"continue pretraining with: python -m engine.train --load {args.save} "
              f"--use-checkpoint-args --data-path PREFIX ... (data prepared with --tokenizer-model "
              f"{args.load})")
        return 0

    return run_tool(body, (CheckpointError, lambda e: f"import error: {e}", 2),
                    (OSError, lambda e: f"import error: {os_error_text(e, parsed['args'].save)}", 1))


if __name__ == "__main__":
    sys.exit(main())
