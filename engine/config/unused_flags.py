"""Flags that a run accepts but that change nothing in its layout: each is said once, as a note.

A field read only under a condition (``--cp-comm-type`` with cp > 1, ``--zero-stage`` with the
distributed optimizer, the loss-scaler flags under fp16, ...) is listed in ``RULES`` with the
condition under which it is *not* read; a user who set it (a flag or a recipe key:
``RunConfig.explicit``) while that condition holds gets one line, ``--flag VALUE has no effect
WHY``, printed by rank 0 as ``gridtron: note: ...`` before the first step. The run goes on: the
value is harmless, but the user meant something by it. Every user-settable field is either in
``RULES`` or in ``ALWAYS_READ`` (read by every run); tests/engine/training/test_unused_flags.py
fails on a field in neither, so a new field is classified when it is added.

Pure: the same notes on every rank, from the configuration, the grid and the device type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.base import ConfigError
from engine.config.fields import field_table
from parallel.dp.policy import CompressionPolicy, PolicyError

# fields every run reads (or whose misuse is refused elsewhere with a ConfigError)
ALWAYS_READ = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "qk_layernorm",
    "ffn_hidden_size", "seq_length", "max_position_embeddings", "vocab_size", "block", "dropout",
    "attention_dropout",
    "init_std", "norm_eps", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_load_balancing_type", "moe_z_loss_coeff",
    "moe_grouped_gemm", "moe_router_enable_expert_bias", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    # Megatron's switch: grouped-query attention is on whenever the groups are fewer than the
    # heads (its help says so); without --num-query-groups it is refused
    "group_query_attention",
    "tp", "pp", "dp", "cp", "order", "recompute", "bucket_size_mb", "backend_rules",
    "stream_check", "expert_model_parallel_size",
    "train_iters", "lr", "lr_warmup_iters", "lr_decay_style", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_eps", "clip_grad", "rerun_on_anomaly", "spike_factor",
    "optimizer_cpu_offload", "host_sync_interval",
    "precision", "fp8_format", "data_path", "split", "mock_data", "micro_batch_size", "global_batch_size",
    "reset_attention_mask", "reset_position_ids", "eod_mask_loss",
    "save", "load", "finetune", "use_checkpoint_args",
    "run_dir", "metrics_file", "timeline", "plot", "log_interval", "eval_interval", "progress",
    "peak_tflops", "tensorboard_dir", "wandb_project", "profile_steps",
    "device", "compile", "seed",
})


@dataclass(frozen=True)
class Facts:
    """What the rules look at besides the configuration."""
    cfg: object
    tp: int
    pp: int
    cp: int
    dp_cp: int        # the ranks gradients are reduced over
    world: int
    device: str       # "cpu", "cuda" or "npu"
    rope: bool        # the block uses rotary position embeddings


@dataclass(frozen=True)
class Rule:
    fields: tuple[str, ...]
    unused: Callable[[Facts], bool]   # the condition under which the fields change nothing
    why: str                          # "with --cp 1 ...": completes "--flag VALUE has no effect"


def _kind(f: Facts) -> str:
    return f.cfg.compression.grad_compression


COMPRESSION_FLAGS = ("grad_compression", "grad_compression_ratio", "grad_compression_warmup_steps",
                     "grad_compression_warmup_fraction", "grad_compression_variance_refresh",
                     "grad_compression_sparsity_warmup_steps")

RULES = (
    Rule(("cp_comm_type",), lambda f: f.cp == 1,
         "with --cp 1: it chooses the context-parallel attention; drop it or raise --cp"),
    Rule(("pipeline_schedule", "virtual_pipeline_size", "stage_end_weight"), lambda f: f.pp == 1,
         "with --pp 1: there is no pipeline; drop it or raise --pp"),
    Rule(("scatter_gather_tensors_in_pipeline",),
         lambda f: f.pp == 1 or f.tp == 1 or f.cfg.parallel.sequence_parallel,
         "without --pp > 1 and --tp > 1 (and without --sequence-parallel, whose stage boundary "
         "tensors are already split); drop it"),
    Rule(("sequence_parallel", "tp_comm_overlap"), lambda f: f.tp == 1,
         "with --tp 1: there is no tensor-parallel group; drop it or raise --tp"),
    Rule(("expert_tensor_parallel_size",), lambda f: f.cfg.model.num_experts is None,
         "without --num-experts: there are no experts to split; drop it"),
    Rule(("moe_token_dispatcher_type",), lambda f: f.cfg.parallel.expert_model_parallel_size == 1,
         "with --expert-model-parallel-size 1: every rank holds every expert, no tokens are "
         "exchanged; drop it or raise --ep"),
    Rule(("moe_router_bias_update_rate",), lambda f: not f.cfg.model.moe_router_enable_expert_bias,
         "without --moe-router-enable-expert-bias; drop it or enable the bias"),
    Rule(("moe_aux_loss_coeff",),
         lambda f: f.cfg.model.moe_router_load_balancing_type == "none",
         "with --moe-router-load-balancing-type none; drop it or choose a balancing loss"),
    Rule(("rope_base",), lambda f: not f.rope,
         "on a block without rotary position embeddings (--block llama has them); drop it"),
    Rule(("use_distributed_optimizer", "data_parallel_sharding_strategy"),
         lambda f: f.dp_cp == 1 and not f.cfg.optim.optimizer_cpu_offload,
         "with one data-parallel rank (dp x cp = 1) and no --optimizer-cpu-offload: there is "
         "nothing to shard; drop it or add data-parallel ranks"),
    Rule(("overlap_grad_reduce",), lambda f: f.dp_cp == 1,
         "with one data-parallel rank (dp x cp = 1): there is nothing to shard or reduce; drop it "
         "or add data-parallel ranks"),
    Rule(("optimizer_offload_fraction",), lambda f: not f.cfg.optim.optimizer_cpu_offload,
         "without --optimizer-cpu-offload; add it or drop the flag"),
    Rule(("zero_stage", "overlap_param_gather"),
         lambda f: not f.cfg.parallel.use_distributed_optimizer,
         "without --use-distributed-optimizer; add it (ZeRO) or drop the flag"),
    Rule(COMPRESSION_FLAGS + ("grad_compression_policy",),
         lambda f: f.dp_cp == 1 and (_kind(f) != "none"
                                     or bool(f.cfg.compression.grad_compression_policy)),
         "with one data-parallel rank (dp x cp = 1): nothing is exchanged to compress; drop it or "
         "add data-parallel ranks"),
    Rule(COMPRESSION_FLAGS[1:], lambda f: bool(f.cfg.compression.grad_compression_policy),
         "beside --grad-compression-policy, whose rules replace the --grad-compression-* flags; "
         "put the setting into the policy"),
    Rule(("grad_compression_ratio", "grad_compression_sparsity_warmup_steps"),
         lambda f: _kind(f) != "topk", "without --grad-compression topk; drop it"),
    Rule(("grad_compression_warmup_steps",), lambda f: _kind(f) == "none",
         "without --grad-compression; drop it"),
    Rule(("grad_compression_warmup_fraction", "grad_compression_variance_refresh"),
         lambda f: _kind(f) not in ("topk", "onebit"),
         "without --grad-compression topk or onebit (int8 keeps Adam's second moment and warms up "
         "for 4 steps, or --grad-compression-warmup-steps); drop it"),
    Rule(("grad_compression_warmup_fraction",),
         lambda f: f.cfg.compression.grad_compression_warmup_steps is not None,
         "beside --grad-compression-warmup-steps, which sets the warm-up; give one of them"),
    Rule(("min_lr", "lr_decay_iters"), lambda f: f.cfg.optim.lr_decay_style == "constant",
         "with --lr-decay-style constant: the learning rate stays at --lr; drop it or choose a "
         "decay"),
    Rule(("spike_window",), lambda f: not f.cfg.optim.spike_factor,
         "without --spike-factor F; add it or drop the flag"),
    Rule(("initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"),
         lambda f: f.cfg.precision.precision != "fp16",
         "outside --precision fp16 (only fp16 scales the loss); drop it"),
    Rule(("fp8_recipe", "first_last_layers_bf16"), lambda f: f.cfg.precision.fp8_format is None,
         "without --fp8-format (the GEMMs run in bf16); add it or drop the flag"),
    Rule(("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"),
         lambda f: f.cfg.precision.fp8_format is None or not f.cfg.precision.first_last_layers_bf16,
         "without --fp8-format and --first-last-layers-bf16; add them or drop the flag"),
    Rule(("allow_tf32",), lambda f: f.cfg.precision.precision != "fp32" or f.device == "cpu",
         "outside fp32 on a GPU or NPU (TF32/HF32 units run fp32 matmuls only); drop it"),
    Rule(("tokenizer", "cache_dir"), lambda f: f.cfg.data.mock_data or bool(f.cfg.data.data_path),
         "with --data-path or --mock-data: it belongs to the built-in corpus; drop it"),
    Rule(("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"),
         lambda f: f.cfg.data.mock_data, "with --mock-data: nothing is tokenized; drop it"),
    Rule(("save_interval", "keep_last", "async_save", "overwrite"),
         lambda f: not f.cfg.checkpoint.save,
         "without --save (or --run-dir): nothing is saved; add one or drop the flag"),
    Rule(("load_optim", "load_rng"), lambda f: not f.cfg.checkpoint.load or f.cfg.checkpoint.finetune,
         "without --load, or with --finetune (weights only); drop it"),
    Rule(("timeout_s", "distributed_backend", "log_straggler", "straggler_threshold"),
         lambda f: f.world == 1,
         "in a single process: there are no peers; drop it"),
    Rule(("straggler_threshold",), lambda f: not f.cfg.log.log_straggler,
         "with --no-log-straggler; drop it"),
    Rule(("eval_iters",), lambda f: not f.cfg.log.eval_interval,
         "without --eval-interval N: nothing is validated; add it or drop the flag"),
    Rule(("wandb_exp_name", "wandb_save_dir", "wandb_mode"), lambda f: not f.cfg.log.wandb_project,
         "without --wandb-project; add it or drop the flag"),
    Rule(("profile_dir",), lambda f: not f.cfg.log.profile_steps,
         "without --profile-steps A-B; add it or drop the flag"),
)


def shown(name: str, value) -> str:
    """A field's setting as it is typed: ``--sequence-parallel``, ``--no-log-straggler``,
    ``--cp-comm-type a2a``."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    if isinstance(value, list):
        value = " ".join(map(str, value))
    return f"--{flag} {value}"


def unused_flag_notes(cfg, grid, device: str, rope: bool) -> list[str]:
    """One note per flag the user set that has no effect in this run (first matching rule)."""
    facts = Facts(cfg, grid.tp, grid.pp, grid.cp, grid.dp * grid.cp, grid.world_size, device, rope)
    notes, said = [], set()
    for rule in RULES:
        given = [name for name in rule.fields if name in cfg.explicit and name not in said]
        if not given or not rule.unused(facts):
            continue
        for name in given:
            said.add(name)
            notes.append(f"{shown(name, _value(cfg, name))} has no effect {rule.why}")
    return notes


def compression_notes(cfg, grid) -> list[str]:
    """A warm-up that is not shorter than the run: the run never compresses. A policy that is
    not valid is the configuration error the trainer would raise."""
    if grid.dp * grid.cp == 1:
        return []
    try:
        policy = CompressionPolicy.coerce(cfg.compression, cfg.optim.train_iters)
    except PolicyError as exc:
        raise ConfigError(f"grad_compression_policy: {exc}") from exc
    iters = cfg.optim.train_iters
    if not policy.any_compressed or policy.warmup_steps < iters:
        return []
    c = cfg.compression
    how = (f"--grad-compression-warmup-steps {c.grad_compression_warmup_steps}"
           if c.grad_compression_warmup_steps is not None else
           f"the warm-up of {policy.warmup_steps} steps")
    return [f"{how} is not shorter than the run (--train-iters {iters}): every step exchanges "
            f"uncompressed gradients and --grad-compression {c.grad_compression} never starts; "
            f"shorten the warm-up or train longer"]


def _value(cfg, name: str):
    section = field_table()[name].section
    return getattr(getattr(cfg, section) if section else cfg, name)
