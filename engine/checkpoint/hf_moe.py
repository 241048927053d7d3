"""Hugging Face mixture-of-experts models in and out: Mixtral and Qwen3-MoE (import_hf.py and
export.py call these; the dense llama-family mapping of attention and norms is theirs).

Configuration. Both are llama blocks with grouped-query attention; Qwen3-MoE adds the per-head
query/key RMSNorm (``--qk-layernorm``). ``num_local_experts`` (Qwen3-MoE: ``num_experts``) is
``--num-experts``, ``num_experts_per_tok`` ``--moe-router-topk``. Routing: both take a softmax over
all experts and the top-k of it. Mixtral then renormalises over the K chosen, which is the
engine's default (top-k of the logits, a softmax over the chosen: the same weights); Qwen3-MoE
does so when ``norm_topk_prob`` is true (the default router again) and otherwise keeps the
probabilities as they are (``--moe-router-pre-softmax``). Mixtral's experts are
``intermediate_size`` wide in every layer; Qwen3-MoE's are ``moe_intermediate_size`` wide
(``--moe-ffn-hidden-size``) in the layers that ``decoder_sparse_step`` and ``mlp_only_layers``
choose (layer i is MoE when i is not in mlp_only_layers and (i + 1) % step == 0: written to
``--moe-layer-freq`` as a 0/1 list), the other layers dense MLPs ``intermediate_size`` wide. A
router the engine cannot reproduce (a scoring function other than softmax, grouped or
bias-corrected top-k, a routed scaling factor, a router bias, shared experts, jitter noise) is
refused with the field's name. The balancing loss is the run's choice (``--moe-aux-loss-coeff``;
off in the imported configuration, as transformers trains without router logits by default).

Weights. Expert e of layer L is ``layers.L.mlp.experts.experts.e.{gate,up,fc2}.weight`` here
(SwiGLU without bias), the router ``layers.L.mlp.router.weight`` (E, h). Transformers 5 holds a
layer's experts fused in memory, ``mlp.experts.gate_up_proj`` (E, 2F, h: gate rows, then up) and
``mlp.experts.down_proj`` (E, h, F), and ``save_pretrained`` writes them per expert: Mixtral's
``block_sparse_moe.experts.e.w1`` (gate), ``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate``,
Qwen3-MoE's ``mlp.experts.e.{gate,up,down}_proj`` and ``mlp.gate``. Import reads either form;
export writes the per-expert one, which is what transformers saves and loads.
"""
from __future__ import annotations

from engine.checkpoint.index import CheckpointError

# config.json fields of routers the engine does not build, and the value that would be harmless
UNSUPPORTED_ROUTER = (("scoring_func", ("softmax",)), ("topk_method", ("greedy",)),
                      ("n_group", (1,)), ("topk_group", (1,)), ("routed_scaling_factor", (1, 1.0)),
                      ("router_bias", (False,)), ("moe_router_bias", (False,)),
                      ("n_shared_experts", (0,)), ("shared_expert_intermediate_size", (0,)),
                      ("router_jitter_noise", (0, 0.0)))


def check_router_fields(c: dict, hf_dir: str) -> None:
    """One line naming the first router field of config.json the engine cannot reproduce."""
    for key, harmless in UNSUPPORTED_ROUTER:
        value = c.get(key)
        if value is not None and value not in harmless:
            raise CheckpointError(f"{hf_dir}/config.json: {key} = {value!r} is a router the engine "
                                  f"does not build (softmax top-k without bias, groups, scaling or "
                                  f"shared experts); this model cannot be imported")


def _experts(c: dict, hf_dir: str, key: str, count) -> tuple[int, int]:
    e = count(c, key, hf_dir) if key in c else count(c, "num_local_experts", hf_dir)
    k = count(c, "num_experts_per_tok", hf_dir)
    if k > e:
        raise CheckpointError(f"{hf_dir}/config.json: num_experts_per_tok {k} is above the {e} "
                              f"experts")
    return e, k


def mixtral_fields(c: dict, hf_dir: str, count) -> dict:
    """GPTConfig's MoE fields for a Mixtral config.json (every layer MoE, renormalised top-k);
    ``count(c, key, hf_dir[, default])`` reads a positive integer field (import_hf's)."""
    check_router_fields(c, hf_dir)
    e, k = _experts(c, hf_dir, "num_local_experts", count)
    width = count(c, "intermediate_size", hf_dir)
    return {"num_experts": e, "moe_router_topk": k, "moe_ffn_hidden_size": width,
            "moe_layer_freq": "1", "moe_aux_loss_coeff": 0.0}


def qwen3_moe_fields(c: dict, hf_dir: str, layers: int, count) -> dict:
    """GPTConfig's MoE fields for a Qwen3-MoE config.json (``count``: as for Mixtral)."""
    check_router_fields(c, hf_dir)
    e, k = _experts(c, hf_dir, "num_experts", count)
    norm = c.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise CheckpointError(f"{hf_dir}/config.json: norm_topk_prob is {norm!r}, not true or false")
    step = count(c, "decoder_sparse_step", hf_dir, 1)
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(type(i) is not int or not 0 <= i < layers for i in dense):
        raise CheckpointError(f"{hf_dir}/config.json: mlp_only_layers {dense!r} is not a list of "
                              f"layer indices below num_hidden_layers {layers}")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise CheckpointError(f"{hf_dir}/config.json: decoder_sparse_step {step} and mlp_only_layers "
                              f"leave no MoE layer; import it as a dense model")
    freq = "1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"
    return {"num_experts": e, "moe_router_topk": k, "moe_router_pre_softmax": not norm,
            "moe_ffn_hidden_size": count(c, "moe_intermediate_size", hf_dir),
            "moe_layer_freq": freq, "moe_aux_loss_coeff": 0.0}


def import_moe_layer(w: dict, src: str, dst: str, experts: int, mixtral: bool) -> dict:
    """Our router and experts of one layer from the HF weights ``w`` under ``src``
    ("model.layers.L"): the fused (E, 2F, h) / (E, h, F) tensors or the per-expert ones. Any
    other weight of the layer's MoE block (a router or expert bias, a correction bias, a shared
    expert) is a CheckpointError naming it."""
    fused = f"{src}.mlp.experts.gate_up_proj"
    block = f"{src}.block_sparse_moe" if mixtral and fused not in w else f"{src}.mlp"
    used = {f"{block}.gate.weight"}
    sd = {f"{dst}.mlp.router.weight": w[f"{block}.gate.weight"]}
    names = ("w1", "w3", "w2") if block.endswith("block_sparse_moe") else \
        ("gate_proj", "up_proj", "down_proj")
    if fused in w:
        gate_up, down = w[fused], w[f"{src}.mlp.experts.down_proj"]  # (E, 2F, h), (E, h, F)
        used |= {fused, f"{src}.mlp.experts.down_proj"}
        if gate_up.ndim != 3 or gate_up.shape[0] != experts:
            raise RuntimeError(f"{fused} has shape {list(gate_up.shape)}, not ({experts}, 2F, h)")
    for e in range(experts):
        out = f"{dst}.mlp.experts.experts.{e}"
        if fused in w:
            gate, up = gate_up[e].chunk(2, dim=0)  # (F, h) each: the gate rows come first
            sd.update({f"{out}.gate.weight": gate, f"{out}.up.weight": up, f"{out}.fc2.weight": down[e]})
            continue
        theirs = [f"{block}.experts.{e}.{n}.weight" for n in names]
        sd.update({f"{out}.{ours}.weight": w[t] for ours, t in zip(("gate", "up", "fc2"), theirs)})
        used |= set(theirs)
    left = sorted(k for k in w if k.startswith(f"{block}.") and k not in used)
    if left:
        raise CheckpointError(f"weight {left[0]} has no place in the engine's MoE layer (a router "
                              f"or expert bias, a correction bias or a shared expert is not "
                              f"built); this model cannot be imported")
    return sd


def export_family(m: dict) -> str:
    """The transformers family a llama-block checkpoint's model ``m`` exports as: llama, qwen3,
    mixtral or qwen3_moe; CheckpointError (one line) for a model none of them can hold."""
    qk = m.get("qk_layernorm", False)
    if m.get("num_experts") is None:
        return "qwen3" if qk else "llama"
    from models.moe.config import moe_layer_pattern
    why = None
    if m.get("moe_router_score_function", "softmax") != "softmax" or m.get("moe_router_enable_expert_bias"):
        why = "sigmoid router scores or an expert bias (transformers' Mixtral and Qwen3-MoE route by softmax)"
    elif m.get("moe_shared_expert_intermediate_size") is not None:
        why = "a shared expert (Mixtral and Qwen3-MoE have none)"
    elif not qk and m.get("moe_router_pre_softmax"):
        why = "--moe-router-pre-softmax without --qk-layernorm (Mixtral renormalises the top-k)"
    elif not qk and not all(moe_layer_pattern(m.get("moe_layer_freq", "1"), m["num_layers"])):
        why = "dense layers without --qk-layernorm (Mixtral's layers are all MoE layers)"
    if why:
        raise CheckpointError(f"--to hf: this MoE model has {why}; no transformers model holds it")
    return "qwen3_moe" if qk else "mixtral"


def export_moe_layer(get, src: str, dst: str, m: dict, mixtral: bool) -> dict:
    """HF per-expert weights of our MoE layer ``src`` ("layers.L"), under ``dst`` ("model.layers.L")."""
    block = f"{dst}.block_sparse_moe" if mixtral else f"{dst}.mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    sd = {f"{block}.gate.weight": get(f"{src}.mlp.router.weight")}
    for e in range(m["num_experts"]):
        ours = f"{src}.mlp.experts.experts.{e}"
        for part, theirs in zip(("gate", "up", "fc2"), names):
            sd[f"{block}.experts.{e}.{theirs}.weight"] = get(f"{ours}.{part}.weight")
    return sd


def export_moe_config(m: dict, family: str) -> dict:
    """The MoE part of config.json for ``family`` (mixtral or qwen3_moe)."""
    from models.moe.config import moe_layer_pattern
    out = {"num_experts_per_tok": m["moe_router_topk"], "router_aux_loss_coef": m["moe_aux_loss_coeff"],
           "output_router_logits": False}
    if family == "mixtral":
        return {**out, "num_local_experts": m["num_experts"], "router_jitter_noise": 0.0,
                "intermediate_size": m["moe_ffn_hidden_size"], "sliding_window": None}
    pattern = moe_layer_pattern(m["moe_layer_freq"], m["num_layers"])
    return {**out, "num_experts": m["num_experts"], "moe_intermediate_size": m["moe_ffn_hidden_size"],
            "norm_topk_prob": not m["moe_router_pre_softmax"], "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe]}

