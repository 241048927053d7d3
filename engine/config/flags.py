"""The command line's one table: help, group, Megatron spellings and choices of every config field.

Each field of the config dataclasses (engine/config/schema.py, parallel.py, models/config.py) becomes ``--field-name``;
``FLAGS`` says how it is presented. A field without an entry here fails ``tests/engine/config/test_cli.py``: add
one when you add a field. Entries for fields that do not exist yet are allowed (they take effect
when the field appears). ``MEGATRON_ANSWERS`` answers Megatron-LM flags that have no field here, so
a user typing from habit learns what to do instead; ``CHOICE_ANSWERS`` does the same for Megatron
values of a real flag that are not built here (``--fp8-recipe delayed``); both live in
engine/config/megatron_answers.py. Neither may name a flag that does not exist, and
``MEGATRON_ANSWERS`` no flag that does (tests/engine/config/test_cli.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.parallel import BACKEND_RULES, CP_COMM_TYPES, DIST_BACKENDS, RECOMPUTE, SCHEDULES
from engine.config.schema import (COMPRESSORS, DECAY_STYLES, DEVICES, FP8_FORMATS, FP8_RECIPES, PRECISIONS,
                                  WANDB_MODES)
from engine.config.sharding import STRATEGIES
from engine.data.hf_tokenizer import TOKENIZER_TYPES

GROUPS = ("model", "parallelism", "training", "mixed precision", "data", "checkpoints", "logging")


@dataclass(frozen=True)
class Flag:
    help: str
    group: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    default_text: str | None = None  # shown instead of the dataclass default (e.g. a derived one)


F = Flag
FLAGS: dict[str, Flag] = {
    # ---- model -------------------------------------------------------------------------------
    "num_layers": F("transformer blocks", "model"),
    "hidden_size": F("width of the residual stream h", "model", ("--hidden",)),
    "num_attention_heads": F("attention heads (a multiple of --tp)", "model", ("--heads",)),
    "num_query_groups": F("key/value head groups for grouped-query attention (--num-attention-heads "
                          "must be a multiple)", "model"),
    "group_query_attention": F("Megatron's switch for grouped-query attention; give the group count "
                               "with --num-query-groups (on its own it is an error)", "model"),
    "qk_layernorm": F("RMSNorm over each attention head's query and key (one head_dim-wide weight "
                      "each, shared by the heads) before rotary embeddings, as Qwen3 and OLMo2", "model"),
    "ffn_hidden_size": F("MLP width", "model", default_text="4h for gpt2, 8h/3 rounded to 64 for llama"),
    "seq_length": F("tokens per sample", "model", ("--seq-len",)),
    "max_position_embeddings": F("length of the position table (learned positions) or of the RoPE "
                                 "range", "model", default_text="--seq-length"),
    "vocab_size": F("vocabulary size; only for --mock-data or data without a tokenizer (otherwise the "
                    "data's, and a different value is an error)", "model", default_text="the data's"),
    "block": F("transformer block: gpt2, llama, or module:Class for your own", "model"),
    "dropout": F("dropout on residual branches and embeddings, and on attention probabilities "
                 "unless --attention-dropout is given", "model", ("--hidden-dropout",)),
    "attention_dropout": F("dropout on attention probabilities", "model",
                           default_text="--dropout"),
    "init_std": F("standard deviation of the normal weight initialisation", "model",
                  ("--init-method-std",)),
    "norm_eps": F("epsilon of LayerNorm / RMSNorm", "model", ("--norm-epsilon", "--layernorm-epsilon")),
    "rope_base": F("rotary embedding base (llama)", "model", ("--rotary-base",)),
    "num_experts": F("experts per mixture-of-experts layer (off by default; docs/moe.md)", "model"),
    "moe_layer_freq": F("which layers are MoE layers: N (every N-th, from layer 0) or a 0/1 list "
                        "per layer such as [0,1,1,1]", "model"),
    "moe_ffn_hidden_size": F("width of each expert's MLP", "model", default_text="--ffn-hidden-size"),
    "moe_shared_expert_intermediate_size": F("width of an always-active shared expert (none by "
                                             "default)", "model"),
    "moe_router_topk": F("experts each token is routed to (K)", "model"),
    "moe_router_score_function": F("router scores: softmax (top-k of the logits, softmax over the "
                                   "chosen) or sigmoid", "model", choices=("softmax", "sigmoid")),
    "moe_router_pre_softmax": F("softmax over all experts before the top-k (not renormalised)",
                                "model"),
    "moe_router_load_balancing_type": F("balancing loss: aux_loss (global: over each micro-step's "
                                        "tokens of all DP x CP ranks, like Megatron's "
                                        "global_aux_loss without its running average over "
                                        "micro-batches; Megatron's aux_loss is per micro-batch "
                                        "over TP x CP), seq_aux_loss (per sequence) or none",
                                        "model", choices=("aux_loss", "seq_aux_loss", "none")),
    "moe_aux_loss_coeff": F("weight of the balancing loss (0: off)", "model"),
    "moe_z_loss_coeff": F("weight of the router z-loss (none: off)", "model"),
    "moe_token_dispatcher_type": F("token exchange between expert-parallel ranks: alltoall "
                                   "(each assignment to its expert's rank) or allgather (every "
                                   "rank gathers the EP group's tokens, reduce-scatter back)",
                                   "model", choices=("alltoall", "allgather")),
    "moe_grouped_gemm": F("one grouped GEMM per expert projection over the stacked expert weights "
                          "(default; torch._grouped_mm on CUDA in bf16 and on CPU, "
                          "npu_grouped_matmul on Atlas A2/A3); --no-moe-grouped-gemm: a loop of "
                          "F.linear per expert over the same weights", "model"),
    "moe_router_enable_expert_bias": F("aux-loss-free balancing: a per-expert bias on the sigmoid "
                                       "scores for the choice of experts, updated from the global "
                                       "expert load after each step", "model"),
    "moe_router_bias_update_rate": F("step of the expert bias update: bias += rate * "
                                     "sign(mean load - load)", "model"),
    "moe_expert_capacity_factor": F("expert capacity = ceil(F * tokens * K / E) per micro-batch; "
                                    "the lowest-scored assignments beyond it are dropped; 0 < F <= "
                                    "E, and F >= E / K drops nothing (unset: dropless)", "model"),
    "moe_pad_expert_input_to_capacity": F("pad each expert's input to its capacity (fixed shapes, "
                                          "no host read of the counts)", "model"),
    # ---- parallelism -------------------------------------------------------------------------
    "tp": F("tensor-parallel size (inside a node)", "parallelism", ("--tensor-model-parallel-size",)),
    "cp": F("context-parallel size (sequence split across ranks)", "parallelism",
            ("--context-parallel-size",)),
    "cp_comm_type": F("context-parallel attention: p2p (ring attention, K/V blocks travel the CP "
                      "ring, load-balanced causal chunks) or a2a (Ulysses all-to-all from sequence "
                      "to head shards; heads/tp must be divisible by cp)", "parallelism",
                      choices=CP_COMM_TYPES),
    "pp": F("pipeline-parallel size (stages)", "parallelism", ("--pipeline-model-parallel-size",)),
    "dp": F("data-parallel size", "parallelism", ("--data-parallel-size",),
            default_text="world / (tp x cp x pp)"),
    "virtual_pipeline_size": F("model chunks per pipeline stage (interleaved schedule)", "parallelism",
                               ("--virtual-pipeline-model-parallel-size",
                                "--num-virtual-stages-per-pipeline-rank", "--vp")),
    "pipeline_schedule": F("pipeline schedule: gpipe, 1f1b, interleaved (with --vp), or a "
                           "zero-bubble one splitting backwards into B and W: 1f1b-w, zb-h1, zb-v "
                           "(two chunks per rank in a V)", "parallelism", choices=SCHEDULES,
                           default_text="1f1b, or interleaved with --pp > 1 and --vp > 1"),
    "scatter_gather_tensors_in_pipeline": F("without sequence parallelism, send 1/tp of each "
                                            "stage boundary tensor per TP rank and all-gather it "
                                            "on the receiving stage", "parallelism"),
    "stage_end_weight": F("count the embedding / output layer as this many blocks when splitting layers "
                          "over stages (0: split by block count)", "parallelism"),
    "sequence_parallel": F("keep norms, dropout and residuals on a sequence shard (needs --tp > 1)",
                           "parallelism"),
    "tp_comm_overlap": F("with --sequence-parallel: pipeline the all-gather before each "
                         "column-parallel GEMM and the reduce-scatter after each row-parallel GEMM "
                         "with the GEMMs, in tp chunks on a ring of point-to-point transfers (fused "
                         "ops on CUDA/Ascend where available); without it, on --device npu, the "
                         "row-parallel GEMM and its all-reduce as Ascend's fused op "
                         "(docs/communication.md)", "parallelism"),
    "recompute": F("activation recomputation", "parallelism", ("--recompute-granularity",), RECOMPUTE),
    "data_parallel_sharding_strategy": F(
        "what data parallelism shards (Megatron-LM's names): no_shard (ZeRO-0), optim (ZeRO-1: "
        "optimizer state), optim_grads (ZeRO-2: and the fp32 gradients), optim_grads_params "
        "(ZeRO-3: and the parameters, each block's gathered ahead of it and freed after it; "
        "docs/data_parallel.md)", "parallelism", choices=STRATEGIES,
        default_text="from --use-distributed-optimizer and --zero-stage: no_shard"),
    "use_distributed_optimizer": F("the distributed optimizer: shard the optimizer state over DP "
                                   "ranks (= --data-parallel-sharding-strategy optim; --zero-stage "
                                   "2 or 3 shards more)", "parallelism"),
    "zero_stage": F("with --use-distributed-optimizer: 1 shards the optimizer state over DP (ZeRO-1, "
                    "optim); 2 also keeps only this rank's shard of the fp32 gradient once a bucket "
                    "is reduce-scattered (ZeRO-2, optim_grads); 3 also the parameters (ZeRO-3, "
                    "optim_grads_params)", "parallelism", choices=(1, 2, 3), default_text="1"),
    "overlap_grad_reduce": F("launch each gradient bucket's reduction as soon as its last gradient "
                             "is in, during backward (--no-overlap-grad-reduce: all after backward)",
                             "parallelism"),
    "overlap_param_gather": F("with --use-distributed-optimizer: leave each bucket's parameter "
                              "all-gather in flight until the next forward reaches the first module "
                              "using it (--no-overlap-param-gather: wait right after the update; "
                              "always so under --compile)", "parallelism"),
    "order": F("rank order of the grid, fastest-varying first", "parallelism"),
    "bucket_size_mb": F("size of a DP gradient bucket in MiB of fp32 gradients (2^18 elements "
                        "per MiB)", "parallelism"),
    "timeout_s": F("seconds a collective may take before the job ends naming it", "parallelism"),
    "backend_rules": F("check every collective against a backend's rules before it is issued: auto "
                       "(the backend's own on NPU/GPU, none on gloo), none, hccl (Atlas A2/A3), "
                       "hccl:950, nccl; default from GRIDTRON_BACKEND_RULES", "parallelism",
                       choices=BACKEND_RULES),
    "distributed_backend": F("the process groups' backend: auto (hccl on an NPU, nccl on a GPU, "
                             "gloo on the CPU), or gloo on any device: device tensors through "
                             "gloo, which lets the processes of a node that sees one GPU share it "
                             "(NCCL refuses that; each then gets its share of the free memory); "
                             "slow, and gloo has no point-to-point transfer of CUDA tensors",
                             "parallelism", choices=DIST_BACKENDS),
    "stream_check": F("run under the stream-order checker: an access of one storage from two "
                      "streams, worker threads or communicators without an event, wait or join "
                      "between them is reported and ends the run with exit code 1 (slow; for tests "
                      "and python -m engine.fuzz)", "parallelism"),
    "grad_compression": F("DP gradient compression", "parallelism", choices=COMPRESSORS),
    "grad_compression_ratio": F("fraction of entries top-k keeps", "parallelism", ("--topk-ratio",)),
    "grad_compression_warmup_steps": F("optimizer steps that exchange uncompressed gradients before "
                                       "--grad-compression starts (default: the warm-up fraction of "
                                       "--train-iters for onebit and topk, 4 steps for int8); Adam's "
                                       "second moment is frozen after them", "parallelism"),
    "grad_compression_warmup_fraction": F("onebit, topk: the uncompressed warm-up as a fraction of "
                                          "--train-iters, unless --grad-compression-warmup-steps "
                                          "is given", "parallelism"),
    "grad_compression_variance_refresh": F("onebit, topk: when Adam's frozen second moment is "
                                           "refreshed from the DP ranks' local squared gradients: "
                                           "exp (1, 2, 4, ... steps after the warm-up), a number of "
                                           "steps, off (keep the warm-up's), or auto (off)", "parallelism"),
    "grad_compression_sparsity_warmup_steps": F("topk: compressed steps over which the fraction "
                                                "sent falls from 0.25 to the ratio (default 0.2 "
                                                "of --train-iters)", "parallelism"),
    "grad_compression_policy": F("per-branch compression rules as a JSON object (see "
                                 "configs/compression_policy.yaml)", "parallelism"),
    "device": F("device type", "parallelism", choices=DEVICES),
    "expert_model_parallel_size": F("expert-parallel size: ranks (drawn from dp x cp of a stage) "
                                    "over which each MoE layer's experts are split", "parallelism",
                                    ("--ep",)),
    "expert_tensor_parallel_size": F("expert tensor-parallel size: 1, or --tp (the TP group "
                                     "splits every expert)", "parallelism", ("--etp",)),
    # ---- training ----------------------------------------------------------------------------
    "train_iters": F("total optimizer steps (a resumed run continues up to it)", "training", ("--iters",)),
    "micro_batch_size": F("sequences per micro-batch", "training", ("--mbs",)),
    "global_batch_size": F("sequences per optimizer step (micro-batches = global / (micro x dp))",
                           "training", ("--gbs",)),
    "lr": F("peak learning rate", "training"),
    "min_lr": F("learning rate at the end of the decay", "training"),
    "lr_warmup_iters": F("steps of linear warm-up", "training"),
    "lr_decay_style": F("learning-rate decay after warm-up", "training", choices=DECAY_STYLES),
    "lr_decay_iters": F("step at which the decay reaches --min-lr", "training",
                        default_text="--train-iters"),
    "weight_decay": F("AdamW weight decay (not on biases, norms and position tables)", "training"),
    "adam_beta1": F("AdamW beta1", "training"),
    "adam_beta2": F("AdamW beta2", "training"),
    "adam_eps": F("AdamW epsilon", "training"),
    "clip_grad": F("clip the global gradient norm to this (0: off)", "training"),
    "optimizer_cpu_offload": F("keep the distributed optimizer's fp32 master weights and AdamW "
                               "moments in host memory (pinned on a GPU or NPU) and update them "
                               "there: gradient shards copied down as their reduction finishes, "
                               "parameters copied up per bucket; the same model as without "
                               "(docs/data_parallel.md)", "training"),
    "optimizer_offload_fraction": F("with --optimizer-cpu-offload: the share of this rank's "
                                    "optimizer state kept in host memory (whole buckets, the "
                                    "first reduced first); the rest stays on the device",
                                    "training"),
    "seed": F("seed of initialisation, sampling, document split and dropout", "training"),
    "rerun_on_anomaly": F("a non-finite or spiking loss or gradient norm re-runs the step once from "
                          "its saved inputs before any update: a clean re-run (transient fault) is "
                          "applied, a repeated non-finite one stops the run naming the rank, "
                          "micro-batch and parameter", "training"),
    "spike_factor": F("a loss or gradient norm above this many times the median of the last "
                      "--spike-window steps is an anomaly (0: off)", "training"),
    "spike_window": F("steps in the running median of --spike-factor", "training"),
    "compile": F("torch.compile the model chunks with the device's backend", "training"),
    # ---- mixed precision ---------------------------------------------------------------------
    "precision": F("parameter and compute precision (--bf16 / --fp16 also work)", "mixed precision",
                   choices=PRECISIONS),
    "initial_loss_scale": F("fp16: starting loss scale", "mixed precision"),
    "loss_scale_window": F("fp16: steps without overflow before the scale doubles", "mixed precision"),
    "hysteresis": F("fp16: overflows tolerated before the scale halves", "mixed precision"),
    "allow_tf32": F("let fp32 matmuls use TF32 (CUDA) or HF32 (Ascend); MFU then divides by that "
                    "peak", "mixed precision"),
    "min_loss_scale": F("fp16: the scale never drops below this", "mixed precision"),
    "fp8_format": F("FP8 GEMMs in every tensor-parallel layer (QKV, attention output, MLPs; "
                    "forward and both backward GEMMs) and the MoE experts' grouped GEMMs (rowwise "
                    "scales) on top of --bf16: e4m3 for every operand, "
                    "or hybrid (e4m3 forward, e5m2 gradients); needs compute capability 8.9+ "
                    "(H100, H200, Ada, Blackwell) or the CPU (docs/precision.md)",
                    "mixed precision", choices=FP8_FORMATS, default_text="off"),
    "fp8_recipe": F("FP8 scales of the tensor-parallel layers: tensorwise (one per tensor), "
                    "rowwise (one per row along the contraction, powers of two; the MoE experts' "
                    "always), each from the amax of the logical tensor, or blockwise (DeepSeek-V3's "
                    "1x128 tiles and 128x128 weight blocks, with --fp8-format e4m3)",
                    "mixed precision", choices=FP8_RECIPES),
    "first_last_layers_bf16": F("with --fp8-format: keep the first --num-layers-at-start-in-bf16 "
                                "and the last --num-layers-at-end-in-bf16 layers in bf16",
                                "mixed precision"),
    "num_layers_at_start_in_bf16": F("with --first-last-layers-bf16: the first layers kept in "
                                     "bf16", "mixed precision"),
    "num_layers_at_end_in_bf16": F("with --first-last-layers-bf16: the last layers kept in bf16",
                                   "mixed precision"),
    # ---- data --------------------------------------------------------------------------------
    "data_path": F("prepared data: PREFIX (Megatron's PREFIX.bin/.idx), or a blend 'W1 PREFIX1 W2 "
                   "PREFIX2 ...', or several prefixes weighted by size", "data",
                   default_text="the built-in corpus"),
    "split": F("train,validation,test weights; documents are assigned by a seeded shuffle", "data"),
    "mock_data": F("random tokens instead of data (needs --vocab-size)", "data"),
    "tokenizer": F("tokenizer of the built-in corpus: byte or bpe:N", "data"),
    "tokenizer_type": F("Megatron tokenizer type (with --tokenizer-model, or --vocab-file/--merge-file "
                        "for GPT2BPETokenizer)", "data", choices=TOKENIZER_TYPES),
    "tokenizer_model": F("a tokenizer.json or a Hugging Face tokenizer directory", "data"),
    "vocab_file": F("GPT-2's vocab.json (GPT2BPETokenizer)", "data"),
    "merge_file": F("GPT-2's merges.txt (GPT2BPETokenizer)", "data"),
    "cache_dir": F("cache of the built-in corpus", "data", default_text="~/.cache/gridtron/corpus"),
    "reset_attention_mask": F("packed documents: no attention across end-of-document tokens", "data"),
    "reset_position_ids": F("packed documents: positions restart after each end-of-document token", "data"),
    "eod_mask_loss": F("packed documents: no loss on end-of-document tokens", "data"),
    # ---- checkpoints -------------------------------------------------------------------------
    "save": F("checkpoint directory", "checkpoints", default_text="RUN_DIR/checkpoints with --run-dir"),
    "save_interval": F("save every N steps (0: only at the end)", "checkpoints",
                       ("--persistent-save-interval",)),
    "load": F("checkpoint (or --save root) to start from", "checkpoints"),
    "keep_last": F("checkpoints kept in --save", "checkpoints"),
    "async_save": F("copy each save to host memory at the step boundary and write it in the "
                    "background while training goes on; latest moves once every rank's files are "
                    "complete and verified", "checkpoints"),
    "finetune": F("load only the model weights from --load: step 0, fresh optimizer and sampler",
                  "checkpoints"),
    "load_optim": F("restore the optimizer state from --load (--no-load-optim: fresh AdamW moments)",
                    "checkpoints"),
    "load_rng": F("restore the random states from --load", "checkpoints"),
    "use_checkpoint_args": F("take the model shape (layers, width, heads, block, ...) from --load",
                             "checkpoints"),
    "overwrite": F("let a fresh run replace another run's checkpoints in --save (they are moved aside "
                   "until the new run's first checkpoint is complete)", "checkpoints"),
    # ---- logging -----------------------------------------------------------------------------
    "run_dir": F("root of the run's outputs: metrics.jsonl, timeline.json, loss.png, checkpoints/, "
                 "compile_cache/", "logging"),
    "metrics_file": F("JSONL metrics, one object per step", "logging", default_text="RUN_DIR/metrics.jsonl"),
    "timeline": F("Chrome-trace timeline of the last steps", "logging", default_text="RUN_DIR/timeline.json"),
    "profile_steps": F("optimizer steps A-B (1-based) recorded by torch.profiler (ops, shapes, "
                       "memory), one Perfetto trace per rank", "logging"),
    "profile_dir": F("where --profile-steps writes its traces", "logging",
                     default_text="<run-dir>/profile"),
    "plot": F("PNG of loss and throughput", "logging", default_text="RUN_DIR/loss.png"),
    "log_interval": F("steps between console lines and dashboard points", "logging"),
    "host_sync_interval": F("on a device without its own report of host waits (CPU, NPU), count "
                            "the step's waits (host_syncs) on step 1 and every N-th step, null on "
                            "the others: the counting dispatch mode about doubles a small model's "
                            "host time (1: every step; CUDA counts every step at no cost)",
                            "logging", default_text="--log-interval"),
    "log_straggler": F("every --log-interval steps, compare each rank's compute with its peers' "
                       "(same pipeline stages), name the ranks past --straggler-threshold and the "
                       "rank the others waited for (straggler_rank, straggler_ratio, "
                       "straggler_waited_for)", "logging"),
    "straggler_threshold": F("report a rank as a straggler when its compute exceeds its peers' (same "
                             "pipeline stage and role) by this ratio", "logging"),
    "eval_interval": F("validate every N steps (0: never)", "logging"),
    "eval_iters": F("global batches per validation", "logging"),
    "progress": F("progress bar on stderr (default: when stderr is a terminal)", "logging"),
    "peak_tflops": F("device peak TFLOP/s for MFU", "logging", default_text="from the hardware table"),
    "tensorboard_dir": F("write TensorBoard event files here", "logging"),
    "wandb_project": F("log to this Weights & Biases project (pip install wandb)", "logging"),
    "wandb_exp_name": F("W&B run name", "logging"),
    "wandb_save_dir": F("where W&B keeps its files", "logging", default_text="RUN_DIR, else ."),
    "wandb_mode": F("W&B mode (offline needs no network; wandb sync uploads later)", "logging",
                    choices=WANDB_MODES),
}

# Megatron spellings that set a field to one value.
CONSTANTS = {
    "--bf16": ("precision", "bf16", "same as --precision bf16", "mixed precision"),
    "--fp16": ("precision", "fp16", "same as --precision fp16", "mixed precision"),
    "--recompute-activations": ("recompute", "selective", "same as --recompute selective", "parallelism"),
}
