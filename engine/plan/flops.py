"""FLOPs of a GPT training step: the model's count (MFU) and the executed count (HFU).

API (pure arithmetic; only ``count_flops`` imports torch, when called)::

    formula_block(block) -> "gpt2" | "llama" | None
        the formula that covers a block, given a registry name or the block class; None means
        "no formula for this block" (a user's block, or a subclass of a built-in one that
        overrides ``forward``): report null FLOPs and MFU/HFU, warn once, or measure with
        count_flops
    step_flops(global_batch, seq_length, num_layers, hidden, vocab, ffn_hidden=None,
               block="gpt2", recompute="none", recompute_early_stop=True,
               padded_vocab=None) -> StepFlops(model=, executed=)
        model:    the model's FLOPs of one optimizer step, whatever is recomputed (MFU's numerator),
                  its logits over the ``vocab`` tokens the model has
        executed: what the step runs, recomputed forwards, padded expert rows and the output
                  layer's padded vocabulary columns (``padded_vocab``) included (HFU's
                  numerator); by default this engine's full recomputation with --dropout 0
                  (see "early stop" below)
    recompute_stops_early(dropout) -> bool
        whether that early stop holds (only with no residual dropout): step_flops'
        recompute_early_stop for a run
    attention_core_step_flops(global_batch, seq_length, num_layers, hidden, recompute="none")
        the attention core's part of ``executed`` (Q K^T and scores x V, counted in full)
    count_flops(fn, *args, **kwargs) -> (result, flops)
        torch.utils.flop_counter's count of whatever ``fn`` runs (forward and backward if fn runs
        both): the fallback for blocks without a formula
    achieved_tflops(flops, step_time_s, devices), utilization(achieved, peak)  (MFU or HFU)

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

This is the model count, V the model's vocabulary. The engine allocates the output layer (and the
embedding) with the vocabulary padded to a multiple of 128 x tp (parallel.tensor_parallel
``padded_vocab_size``; the planner's ``ModelShape.padded_vocab(tp)``) and computes those zero
columns too: ``padded_vocab`` = V_pad puts 6 h (V_pad - V) per token in the executed count only
(``StepFlops.vocab_padding``); the model count, MFU's, stays at V, as the engine's measured MFU
(engine/observe/utilization.py) counts it.

Full activation recomputation in Megatron-LM runs every layer's forward a second time (not the
logit layer), so the executed count is four forwards of the layers::

    F_full = 4 B s l (8h^2 + 2 n_mat h f + 4 s h) + 6 B s h V
           = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))        (gpt2, f = 4h)

This engine recomputes with ``torch.utils.checkpoint(use_reentrant=False)``, whose early stop
(on by default) ends the recomputation once every tensor backward needs is rebuilt. Without
dropout nothing inside the layer saves the output of its last matrix multiply (the MLP's down
projection, h x f), so that one is not run again: ``recompute_early_stop=True`` (the default)
subtracts 2 h f per token per layer from F_full; ``False`` gives Megatron's count above. With a
residual dropout (``--dropout`` > 0) the dropout after the down projection keeps its mask, and the
recomputation runs the whole forward again: ``recompute_stops_early(dropout)`` says which holds. tests/engine/plan/test_flops.py checks the engine's
count against torch.utils.flop_counter on the engine's own model, and Megatron's against the
closed forms.

Selective recomputation (Korthikanti et al. 2022) recomputes only the attention core (Q K^T,
softmax, dropout, scores x V), adding its forward, 4 s h per token per layer::

    F_selective = F + 4 B s^2 l h

The attention core is counted in full (s^2, causal masking not discounted), as Megatron does;
``attention_core_step_flops`` is its part of the executed count, which a causal kernel that skips
the masked half runs about half of (the start-up line's lower bound on the step time counts it so).

Mixture of experts (``moe=MoEShape``, docs/moe.md). An MoE layer's MLP is replaced by what a token
actually runs: the router (h x E), its K experts (n_mat matrices of h x f_e each) and the shared
expert when there is one (h x f_s)::

    MLP_moe = 2 h E + 2 n_mat h (K f_e + f_s)        per token, forward

so MFU is against the active parameters, as Megatron reports MoE models. The count is the dropless
one: assignments a capacity drops are still counted. With ``--moe-pad-expert-input-to-capacity``
(``MoEShape.padded_capacity_factor`` F) every expert runs exactly C = ceil(F T K / E) rows per
forward of T routed tokens (models/moe/capacity.py), E C - T K more than the dropless T K (fewer
when the capacity drops: the padded layout runs the E C rows alone): their expert matrices
(2 n_mat h f_e per row, forward; three forwards per step, four under full recomputation) count in
the executed FLOPs only, per MoE layer and forward, with ``routed_tokens`` = T (``routed_tokens()``:
the micro-batch's tokens on one rank). Under full
recomputation with the early stop, an MoE layer's last matrix multiply whose output nothing saves
is the shared expert's down projection (2 h f_s; none without a shared expert: the experts'
outputs are saved by the weighted combine). tests/engine/plan/test_flops_moe.py checks the count
against torch.utils.flop_counter on the engine's MoE model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BLOCKS = ("gpt2", "llama")
RECOMPUTE = ("none", "selective", "full")
DISPATCHERS = ("alltoall", "allgather")  # --moe-token-dispatcher-type (models/moe/config.py)
_MLP_MATRICES = {"gpt2": 2, "llama": 3}
# The built-in block classes the formulas describe (models/blocks.py), by module and name, so this
# module needs no torch import to recognise them.
_BUILTIN_CLASSES = {("models.blocks", "GPT2Block"): "gpt2", ("models.blocks", "LlamaBlock"): "llama"}


def formula_block(block) -> str | None:
    """Which formula covers ``block`` (a registry name or a block class), or None for no formula.

    >>> formula_block("gpt2"), formula_block("llama"), formula_block("mypkg.blocks:MoEBlock")
    ('gpt2', 'llama', None)
    """
    if isinstance(block, str):
        return block if block in BLOCKS else None
    return _BUILTIN_CLASSES.get((getattr(block, "__module__", None), getattr(block, "__qualname__", None)))


def default_ffn_hidden(hidden: int, block: str = "gpt2") -> int:
    """4h for gpt2; for llama 8h/3 rounded up to a multiple of 64 (as models/config.py does)."""
    if block == "llama":
        return (int(8 * hidden / 3) + 63) // 64 * 64
    return 4 * hidden


def _check(block: str, recompute: str) -> None:
    if block not in BLOCKS:
        raise ValueError(f"no FLOPs formula for block {block!r} (formulas: {BLOCKS}); "
                         f"use formula_block() to test first, or count_flops()")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


@dataclass(frozen=True)
class MoEShape:
    """The MoE layers of a model for its FLOPs: ``layers`` of them, ``num_experts`` E, ``topk`` K,
    expert width ``ffn_hidden`` f_e and shared expert width ``shared_ffn`` f_s (0: none)."""
    layers: int
    num_experts: int
    topk: int
    ffn_hidden: int
    shared_ffn: int = 0
    padded_capacity_factor: float | None = None  # --moe-pad-expert-input-to-capacity's factor
    # --moe-token-dispatcher-type: what the EP group moves (no FLOPs; engine/plan/moe_allgather.py)
    dispatcher: str = "alltoall"

    def __post_init__(self):
        if min(self.layers, self.num_experts, self.topk, self.ffn_hidden) < 1 or self.shared_ffn < 0:
            raise ValueError(f"MoEShape needs positive layers, experts, top-k and width: {self}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"MoEShape dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")


def moe_shape(cfg) -> MoEShape | None:
    """The MoEShape of a model config (models.config.GPTConfig), None without MoE layers."""
    if getattr(cfg, "num_experts", None) is None:
        return None
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if not layers:
        return None
    padded = cfg.moe_expert_capacity_factor if getattr(cfg, "moe_pad_expert_input_to_capacity",
                                                       False) else None
    return MoEShape(layers, cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size,
                    cfg.moe_shared_expert_intermediate_size or 0, padded,
                    getattr(cfg, "moe_token_dispatcher_type", "alltoall"))


def routed_tokens(micro_batch: int, seq_length: int, cp: int = 1, tp: int = 1,
                  sequence_parallel: bool = False, etp: int = 1) -> int:
    """Tokens one MoE layer routes per forward on one rank (the T of its capacity): the
    micro-batch's b s / cp, a TP rank's own shard of them under sequence parallelism without
    expert tensor parallelism (ETP gathers the TP group's shards back; models/moe/layer.py)."""
    split = tp if sequence_parallel and tp > 1 and etp == 1 else 1
    return micro_batch * seq_length // (cp * split)


def padded_expert_rows(moe: MoEShape, tokens: int, routed: int | None) -> int:
    """Rows one MoE layer runs beyond the dropless T K over ``tokens`` tokens routed ``routed`` per
    forward with padded experts: (tokens / routed) forwards of E C - T K rows each (negative when
    the capacity drops), C = ceil(F T K / E) as models/moe/capacity.py ``expert_capacity``; 0
    without padding."""
    if moe.padded_capacity_factor is None:
        return 0
    if not routed or tokens % routed:
        raise ValueError(f"padded expert rows need the tokens routed per forward (routed_tokens=), "
                         f"a divisor of the step's {tokens}; got {routed}")
    capacity = expert_capacity(moe, routed)
    return tokens // routed * (moe.num_experts * capacity - routed * moe.topk)


def expert_capacity(moe: MoEShape, routed: int) -> int:
    """C = ceil(F T K / E), at least 1: the rows every expert runs per forward of ``routed`` = T
    tokens padded to capacity (models/moe/capacity.py ``expert_capacity``)."""
    return max(1, math.ceil(moe.padded_capacity_factor * routed * moe.topk / moe.num_experts - 1e-9))


def moe_layer_indices(cfg) -> tuple[int, ...]:
    """The global indices of a model config's MoE layers (none without --num-experts)."""
    if getattr(cfg, "num_experts", None) is None:
        return ()
    return tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))


def moe_mlp_forward_flops(tokens: float, hidden: int, block: str, moe: MoEShape) -> float:
    """Forward FLOPs of one MoE layer's MLP over ``tokens`` tokens: router, K experts, shared."""
    n = _MLP_MATRICES[block]
    return 2.0 * tokens * hidden * (moe.num_experts + n * (moe.topk * moe.ffn_hidden + moe.shared_ffn))


def layer_matmul_params(hidden: int, ffn_hidden: int, block: str = "gpt2",
                        kv_hidden: int | None = None) -> int:
    """Weights of one layer's matrices (biases and norms excluded): 2h^2 + 2 h kv + n_mat h f, where
    kv = G * head_dim is the key/value width (default h: multi-head attention, 4h^2 in all)."""
    kv = hidden if kv_hidden is None else kv_hidden
    return 2 * hidden * hidden + 2 * hidden * kv + _MLP_MATRICES[block] * hidden * ffn_hidden


def layer_forward_flops(tokens: float, seq_length: int, hidden: int, ffn_hidden: int,
                        block: str = "gpt2", kv_hidden: int | None = None) -> float:
    """Forward FLOPs of one layer over ``tokens`` tokens of sequences of ``seq_length``."""
    params = layer_matmul_params(hidden, ffn_hidden, block, kv_hidden)
    return float(tokens) * (2 * params + 4 * seq_length * hidden)


def attention_core_forward_flops(tokens: float, seq_length: int, hidden: int) -> float:
    """Q K^T plus scores x V: what selective recomputation runs again."""
    return 4.0 * tokens * seq_length * hidden


def attention_core_step_flops(global_batch: int, seq_length: int, num_layers: int, hidden: int,
                              recompute: str = "none") -> float:
    """The attention core's part of ``step_flops(...).executed``: forward and backward (three
    forwards), plus the forward again under selective or full recomputation; counted in full."""
    passes = 3 + (recompute in ("selective", "full"))
    return passes * num_layers * attention_core_forward_flops(global_batch * seq_length, seq_length,
                                                              hidden)


def logits_forward_flops(tokens: float, hidden: int, vocab: int) -> float:
    return 2.0 * tokens * hidden * vocab


@dataclass(frozen=True)
class StepFlops:
    model: float  # the model's FLOPs of one step, recomputation excluded (MFU)
    executed: float  # what the step runs, recomputation and padded expert rows included (HFU)
    padded: float = 0.0  # of executed: padded expert rows' (--moe-pad-expert-input-to-capacity)
    vocab_padding: float = 0.0  # of executed: the output layer's padded vocabulary columns'

    @property
    def recomputed(self) -> float:
        return self.executed - self.model - self.padded - self.vocab_padding


def recompute_stops_early(dropout: float) -> bool:
    """Whether this engine's full recomputation stops before each layer's last matrix multiply:
    only when the residual dropout (``--dropout``) is 0. The block ends ``x + drop(mlp(...))``,
    and a dropout keeps its mask, which checkpoint's early stop must rebuild by rerunning the
    down projection (and the collective after it). ``step_flops(..., recompute_early_stop=
    recompute_stops_early(cfg.dropout))`` is the engine's executed count.

    >>> recompute_stops_early(0.0), recompute_stops_early(0.1)
    (True, False)
    """
    return not dropout > 0


def recomputed_layer_flops(tokens: float, seq_length: int, hidden: int, ffn_hidden: int,
                           block: str = "gpt2", recompute: str = "none",
                           recompute_early_stop: bool = True, kv_hidden: int | None = None) -> float:
    """Forward FLOPs one layer runs again over ``tokens`` tokens (see the module docstring)."""
    if recompute == "full":
        skipped = 2.0 * tokens * hidden * ffn_hidden if recompute_early_stop else 0.0
        return layer_forward_flops(tokens, seq_length, hidden, ffn_hidden, block, kv_hidden) - skipped
    if recompute == "selective":
        return attention_core_forward_flops(tokens, seq_length, hidden)
    return 0.0


def step_flops(global_batch: int, seq_length: int, num_layers: int, hidden: int, vocab: int,
               ffn_hidden: int | None = None, block: str = "gpt2", recompute: str = "none",
               recompute_early_stop: bool = True, kv_hidden: int | None = None,
               moe: MoEShape | None = None, routed_tokens: int | None = None,
               padded_vocab: int | None = None) -> StepFlops:
    """Model and executed FLOPs of one optimizer step over ``global_batch`` sequences; ``moe``: of
    the ``num_layers`` layers, ``moe.layers`` have an MoE MLP (active experts counted);
    ``routed_tokens``: the tokens an MoE layer routes per forward, needed with padded experts;
    ``padded_vocab``: the output layer's columns as allocated (>= ``vocab``; None: ``vocab``),
    counted in the executed FLOPs only (the model count stays at ``vocab``).

    Raises ValueError for a block without a formula (check with formula_block first).
    """
    _check(block, recompute)
    f = ffn_hidden if ffn_hidden is not None else default_ffn_hidden(hidden, block)
    tokens = global_batch * seq_length
    layers = num_layers * layer_forward_flops(tokens, seq_length, hidden, f, block, kv_hidden)
    extra = num_layers * recomputed_layer_flops(tokens, seq_length, hidden, f, block, recompute,
                                                recompute_early_stop, kv_hidden)
    if moe is not None:
        if moe.layers > num_layers:
            raise ValueError(f"{moe.layers} MoE layers in a model of {num_layers} layers")
        change = moe_mlp_forward_flops(tokens, hidden, block, moe) - \
            2.0 * tokens * _MLP_MATRICES[block] * hidden * f   # per MoE layer, forward
        layers += moe.layers * change
        if recompute == "full":
            kept = 2.0 * tokens * hidden * (moe.shared_ffn if recompute_early_stop else 0)
            dense_skip = 2.0 * tokens * hidden * f if recompute_early_stop else 0.0
            extra += moe.layers * (change + dense_skip - kept)
    padded = 0.0
    if moe is not None and moe.padded_capacity_factor is not None:
        rows = padded_expert_rows(moe, tokens, routed_tokens)
        passes = 3 + (recompute == "full")   # the experts' forward is recomputed too
        padded = passes * moe.layers * 2.0 * rows * hidden * _MLP_MATRICES[block] * moe.ffn_hidden
    model = 3 * layers + 3 * logits_forward_flops(tokens, hidden, vocab)
    if padded_vocab is not None and padded_vocab < vocab:
        raise ValueError(f"padded_vocab {padded_vocab} is below the vocabulary {vocab}")
    columns = 3 * logits_forward_flops(tokens, hidden, (padded_vocab or vocab) - vocab)
    return StepFlops(model, model + extra + padded + columns, padded, columns)


def model_flops_per_step(global_batch: int, seq_length: int, num_layers: int, hidden: int, vocab: int,
                         ffn_hidden: int | None = None, block: str = "gpt2",
                         recompute: str = "none", kv_hidden: int | None = None) -> float:
    """EXECUTED FLOPs of a step (this engine's recomputation included); kept for existing callers.
    ``kv_hidden`` = num_query_groups * head_dim with grouped-query attention (default: hidden).

    New code: ``step_flops(...).model`` for MFU, ``step_flops(...).executed`` for HFU.
    """
    return step_flops(global_batch, seq_length, num_layers, hidden, vocab, ffn_hidden, block,
                      recompute, kv_hidden=kv_hidden).executed


def megatron_flops_per_step(global_batch: int, seq_length: int, num_layers: int, hidden: int,
                            vocab: int, recompute: str = "none") -> float:
    """The closed forms of Narayanan et al. 2021 (gpt2 block, f = 4h), kept as a cross-check."""
    b, s, l, h, v = global_batch, seq_length, num_layers, hidden, vocab
    if recompute == "full":
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def count_flops(fn, *args, attention: list | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` under torch.utils.flop_counter; return (its result, FLOPs).

    The counter sees matrix multiplies, convolutions and attention kernels (2 FLOPs per
    multiply-add, the convention above); element-wise work is not counted. On the meta device the
    attention kernel is the CPU flash kernel (kernels/attention.py), which torch's counter has no
    formula for: it is counted as SDPA's, in full (no causal discount). ``attention``: a list that
    gets the attention kernels' part of the FLOPs appended.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_flash(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)
    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash})
    with counter:
        result = fn(*args, **kwargs)
    if attention is not None:
        attention.append(float(sum(n for op, n in counter.get_flop_counts().get("Global", {}).items()
                                   if "attention" in str(op))))
    return result, float(counter.get_total_flops())


def achieved_tflops(flops_per_step: float, step_time_s: float, num_devices: int) -> float:
    """TFLOP/s per device: the step's FLOPs spread over all devices and the step's wall time."""
    if step_time_s <= 0 or num_devices < 1:
        raise ValueError(f"need step_time_s > 0 and num_devices >= 1, got {step_time_s}, {num_devices}")
    return flops_per_step / step_time_s / num_devices / 1e12


def utilization(achieved: float, peak: float | None) -> float | None:
    """Fraction of the device peak reached (MFU with model FLOPs, HFU with executed FLOPs);
    None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return achieved / peak


mfu = utilization  # the historical name
