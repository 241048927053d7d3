"""Parsing and checking the mixture-of-experts fields of ``GPTConfig`` (kept apart so that
models/config.py stays the plain table of shapes).

``--moe-layer-freq`` is Megatron-LM's: an integer N (every N-th layer is an MoE layer, counting
from layer 0: N = 1 makes every layer one) or a 0/1 list with one entry per layer, written as
Megatron writes it, e.g. ``"[0,1,1,1]"`` (layer 0 dense, the others MoE); ``"([0]+[1]*3)"`` is
accepted too.
"""
from __future__ import annotations

import ast
import math
import re

SCORE_FUNCTIONS = ("softmax", "sigmoid")
BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")
# the fields that mean nothing without --num-experts, with their defaults
MOE_DEFAULTS = {"moe_layer_freq": "1", "moe_ffn_hidden_size": None,
                "moe_shared_expert_intermediate_size": None, "moe_router_topk": 2,
                "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
                "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
                "moe_z_loss_coeff": None, "moe_token_dispatcher_type": "alltoall",
                "moe_grouped_gemm": True, "moe_router_enable_expert_bias": False,
                "moe_router_bias_update_rate": 1e-3, "moe_expert_capacity_factor": None,
                "moe_pad_expert_input_to_capacity": False}


def moe_layer_pattern(freq, num_layers: int) -> list[bool]:
    """Which layers are MoE layers, from ``--moe-layer-freq`` (see the module docstring).

    >>> moe_layer_pattern("2", 4), moe_layer_pattern("[0,1,1,1]", 4)
    ([True, False, True, False], [False, True, True, True])
    """
    text = str(freq).strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n < 1:
            raise ValueError(f"--moe-layer-freq {text}: use N >= 1 (every N-th layer) or a 0/1 "
                             f"list such as [0,1,1,1]")
        return [i % n == 0 for i in range(num_layers)]
    try:
        value = _list_expression(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"--moe-layer-freq {text!r}: use N (every N-th layer) or a 0/1 list with "
                         f"one entry per layer such as [0,1,1,1]") from None
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise ValueError(f"--moe-layer-freq {text}: the list needs {num_layers} entries "
                         f"(--num-layers), each 0 (dense) or 1 (MoE); got {len(value)}")
    return [bool(v) for v in value]


def _list_expression(text: str) -> list:
    """A list literal, or sums and products of list literals ("[0]+[1]*3"): no names, no calls."""
    def ev(node):
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError("not a list expression")
    value = ev(ast.parse(text, mode="eval").body)
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


def check_moe_fields(cfg) -> None:
    """Raise ValueError (one line) for inconsistent MoE fields of a ``GPTConfig``."""
    if cfg.num_experts is None:
        given = [k for k, d in MOE_DEFAULTS.items() if getattr(cfg, k) != d]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            verb, them = ("configure", "them") if len(given) > 1 else ("configures", "it")
            raise ValueError(f"{flags} {verb} mixture-of-experts layers, which need --num-experts "
                             f"E; add it or drop {them}")
        return
    e, k = cfg.num_experts, cfg.moe_router_topk
    if e < 1:
        raise ValueError(f"--num-experts must be >= 1, got {e}")
    if not 1 <= k <= e:
        raise ValueError(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
    if cfg.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"--moe-router-score-function must be one of {SCORE_FUNCTIONS}, got "
                         f"{cfg.moe_router_score_function!r}")
    if cfg.moe_router_pre_softmax and cfg.moe_router_score_function != "softmax":
        raise ValueError("--moe-router-pre-softmax applies to --moe-router-score-function softmax")
    if cfg.moe_router_load_balancing_type not in BALANCING_TYPES:
        raise ValueError(f"--moe-router-load-balancing-type must be one of {BALANCING_TYPES}, got "
                         f"{cfg.moe_router_load_balancing_type!r}")
    if cfg.moe_token_dispatcher_type not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {cfg.moe_token_dispatcher_type!r}: use one "
                         f"of {', '.join(DISPATCHERS)} (flex/DeepEP is not built)")
    if cfg.moe_aux_loss_coeff < 0 or (cfg.moe_z_loss_coeff or 0.0) < 0:
        raise ValueError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(cfg, key)}")
    f = cfg.moe_expert_capacity_factor
    if f is not None and not math.isfinite(f):
        raise ValueError(f"--moe-expert-capacity-factor {f} must be a finite number > 0 (leave it "
                         f"unset for dropless routing)")
    if f is not None and not f > 0:
        raise ValueError(f"--moe-expert-capacity-factor {f} must be > 0 (leave it unset for "
                         f"dropless routing)")
    if f is not None and f > e:
        # capacity = ceil(F T K / E): at F = E / K every expert can take all T tokens, so nothing
        # drops; above E the padded layout would only grow (and a huge F overflows the count)
        raise ValueError(f"--moe-expert-capacity-factor {f:g} is above --num-experts {e}: a factor "
                         f"of E / K = {e / k:g} already lets every expert take all the tokens (no "
                         f"assignment dropped); give at most {e / k:g} for no drops, or leave it "
                         f"unset for dropless routing")
    if cfg.moe_pad_expert_input_to_capacity and f is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor F "
                         "(dropless routing has no capacity to pad to)")
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias works on sigmoid scores (DeepSeek-V3); "
                         "add --moe-router-score-function sigmoid")
    if not cfg.moe_router_bias_update_rate >= 0:
        raise ValueError(f"--moe-router-bias-update-rate must be >= 0, got "
                         f"{cfg.moe_router_bias_update_rate}")
    moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
