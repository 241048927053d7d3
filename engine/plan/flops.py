"""Training FLOPs of a GPT step (Megatron's count, generalised) and the MFU helpers.

Derivation. A matrix multiply of an (m x k) by a (k x n) matrix costs 2mkn FLOPs. Per token and
per transformer layer, the forward pass does

- attention projections: QKV (h x 3h) and output (h x h)            8 h^2
  (grouped-query attention with G key/value groups of head_dim d: K and V are h x G d, so the
  projections cost 2 (2 h^2 + 2 h G d) = 4 h^2 + 4 h G d, which is 8 h^2 when G d = h)
- attention core: Q K^T and scores x V, each 2 s h                   4 s h
- MLP: gpt2 has two (h x f) matrices, llama's SwiGLU three           2 n_mat h f
  (n_mat = 2 for gpt2, 3 for llama)

and the logit layer adds 2 h V per token. The backward pass costs twice the forward (gradients
with respect to the inputs and to the weights), so a training step is three forwards::

    F = 3 B s [ l (8h^2 + 2 n_mat h f + 4 s h) + 2 h V ]

For gpt2 with f = 4h the bracket is l (24 h^2 + 4 s h) + 2 h V and F is exactly Megatron's
(Narayanan et al. 2021, eq. 3 without recomputation)::

    F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))

Full activation recomputation runs every layer's forward a second time (not the logit layer),
so the layers cost four forwards::

    F_full = 4 B s l (8h^2 + 2 n_mat h f + 4 s h) + 6 B s h V
           = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))        (gpt2, f = 4h)

Selective recomputation (Korthikanti et al. 2022) recomputes only the attention core (Q K^T,
softmax, dropout, scores x V), adding its forward, 4 s h per token per layer::

    F_selective = F + 4 B s^2 l h

These count the FLOPs a step executes ("hardware FLOPs" when recomputing); MFU proper would
use F for every mode. The trainer and the planner both report executed FLOPs.
"""
from __future__ import annotations

BLOCKS = ("gpt2", "llama")
RECOMPUTE = ("none", "selective", "full")
_MLP_MATRICES = {"gpt2": 2, "llama": 3}


def default_ffn_hidden(hidden: int, block: str = "gpt2") -> int:
    """4h for gpt2; for llama 8h/3 rounded up to a multiple of 64 (as models/config.py does)."""
    if block == "llama":
        return (int(8 * hidden / 3) + 63) // 64 * 64
    return 4 * hidden


def _check(block: str, recompute: str) -> None:
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS} for the FLOPs count, got {block!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def layer_matmul_params(hidden: int, ffn_hidden: int, block: str = "gpt2",
                        kv_hidden: int | None = None) -> int:
    """Weights of one layer's matrices (biases and norms excluded): 2h^2 + 2 h kv + n_mat h f, where
    kv = G * head_dim is the key/value width (default h: multi-head attention, 4h^2 in all)."""
    kv = hidden if kv_hidden is None else kv_hidden
    return 2 * hidden * hidden + 2 * hidden * kv + _MLP_MATRICES[block] * hidden * ffn_hidden


def layer_forward_flops(tokens: int, seq_length: int, hidden: int, ffn_hidden: int,
                        block: str = "gpt2", kv_hidden: int | None = None) -> float:
    """Forward FLOPs of one layer over ``tokens`` tokens of sequences of ``seq_length``."""
    params = layer_matmul_params(hidden, ffn_hidden, block, kv_hidden)
    return float(tokens) * (2 * params + 4 * seq_length * hidden)


def attention_core_forward_flops(tokens: int, seq_length: int, hidden: int) -> float:
    """Q K^T plus scores x V: what selective recomputation runs again."""
    return 4.0 * tokens * seq_length * hidden


def logits_forward_flops(tokens: int, hidden: int, vocab: int) -> float:
    return 2.0 * tokens * hidden * vocab


def model_flops_per_step(global_batch: int, seq_length: int, num_layers: int, hidden: int, vocab: int,
                         ffn_hidden: int | None = None, block: str = "gpt2",
                         recompute: str = "none", kv_hidden: int | None = None) -> float:
    """FLOPs one optimizer step executes for ``global_batch`` sequences (see the module docstring);
    ``kv_hidden`` = num_query_groups * head_dim with grouped-query attention (default: hidden)."""
    _check(block, recompute)
    f = ffn_hidden if ffn_hidden is not None else default_ffn_hidden(hidden, block)
    tokens = global_batch * seq_length
    layers = num_layers * layer_forward_flops(tokens, seq_length, hidden, f, block, kv_hidden)
    flops = 3 * layers + 3 * logits_forward_flops(tokens, hidden, vocab)
    if recompute == "full":
        flops += layers
    elif recompute == "selective":
        flops += num_layers * attention_core_forward_flops(tokens, seq_length, hidden)
    return flops


def megatron_flops_per_step(global_batch: int, seq_length: int, num_layers: int, hidden: int,
                            vocab: int, recompute: str = "none") -> float:
    """The closed forms of Narayanan et al. 2021 (gpt2 block, f = 4h), kept as a cross-check."""
    b, s, l, h, v = global_batch, seq_length, num_layers, hidden, vocab
    if recompute == "full":
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def achieved_tflops(flops_per_step: float, step_time_s: float, num_devices: int) -> float:
    """TFLOP/s per device: the step's FLOPs spread over all devices and the step's wall time."""
    if step_time_s <= 0 or num_devices < 1:
        raise ValueError(f"need step_time_s > 0 and num_devices >= 1, got {step_time_s}, {num_devices}")
    return flops_per_step / step_time_s / num_devices / 1e12


def mfu(achieved: float, peak: float | None) -> float | None:
    """Fraction of the device peak reached; None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return achieved / peak
