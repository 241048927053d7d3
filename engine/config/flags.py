"""The command line's one table: help, group, Megatron spellings and choices of every config field.

Each field of the config dataclasses (engine/config/schema.py, parallel.py, models/config.py) becomes ``--field-name``;
``FLAGS`` says how it is presented. A field without an entry here fails ``tests/engine/config/test_cli.py``: add
one when you add a field. Entries for fields that do not exist yet are allowed (they take effect
when the field appears). ``MEGATRON_ANSWERS`` answers Megatron-LM flags that have no field here, so
a user typing from habit learns what to do instead; ``CHOICE_ANSWERS`` does the same for Megatron
values of a real flag that are not built here (``--fp8-recipe delayed``). Neither may name a flag
that does not exist, and ``MEGATRON_ANSWERS`` no flag that does (tests/engine/config/test_cli.py).
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
    "progress": F("progress bar on stderr", "logging"),
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

_BLOCK = ("the block decides it: --block llama (RMSNorm, RoPE, SwiGLU, no biases, untied output) "
          "or --block gpt2 (LayerNorm, learned positions, GELU, biases, tied embeddings)")
_KERNELS = "kernels are chosen per device (kernels/); drop the flag"
_DELAYED = ("delayed scaling (an amax history) is not built: each FP8 scale comes from the "
            "current tensor's amax, per tensor or per row (--fp8-recipe tensorwise|rowwise); drop "
            "the flag")
_FP8_ATTENTION = ("FP8 attention is not built: --fp8-format runs the linear layers' GEMMs in FP8, "
                  "attention in bf16; drop the flag")
_FP4 = "FP4 (NVFP4) is not built; the narrowest GEMMs are FP8: --fp8-format e4m3|hybrid"
_FSDP = ("gridtron's FSDP is ZeRO-3: --data-parallel-sharding-strategy optim_grads_params (or "
         "--use-distributed-optimizer --zero-stage 3) shards parameters, gradients and optimizer "
         "state and gathers each block for its forward and backward")
_PRECISION_AWARE = ("Megatron's precision-aware optimizer is not built: the distributed optimizer "
                    "keeps fp32 master weights, gradients and AdamW moments (on the device, or in "
                    "host memory with --optimizer-cpu-offload); drop the flag")
_OFFLOAD_BUILT_IN = ("--optimizer-cpu-offload always overlaps its copies with the step, in pinned "
                     "host memory on a GPU or NPU, and updates with its own AdamW; drop the flag")
_ACTIVATION_OFFLOAD = ("offloading activations or weights to host memory is not built: save "
                       "activation memory with --recompute selective|full; --optimizer-cpu-offload "
                       "moves the optimizer state to host memory")
_DEEPEP = ("DeepEP (the flex dispatcher) is not built: use --moe-token-dispatcher-type alltoall "
           "(the default) or allgather; drop the flag")
_GROUP_ROUTING = ("group-limited routing (DeepSeek-V3's node groups) is not built: every token "
                  "chooses its --moe-router-topk experts among all of them; drop the flag")
_ONE_MODEL = "there is one model implementation; drop the flag"
_WSD = ("warmup-stable-decay is not built: the decay starts when the warm-up ends (--lr-decay-style "
        "cosine or linear, reaching --min-lr at --lr-decay-iters) or never (constant)")
_RECOMPUTE_LAYERS = ("--recompute full recomputes every layer, each on its own (Megatron's uniform "
                     "method over 1 layer); drop the flag")
_EXIT = ("give the run's length with --train-iters (a resumed run continues up to it); SIGTERM makes "
         "the run save (with --save) and stop after its current step; drop the flag")
_CKPT = ("checkpoints are one safetensors file per rank with an index, loadable under any layout "
         "(docs/checkpoints.md); drop the flag")
_PROFILE = ("give the steps with --profile-steps A-B: torch.profiler records optimizer steps A to B "
            "(1-based), one trace per rank, in --profile-dir")
_PIPELINE_SPLIT = ("layers are split evenly over the --pp x --virtual-pipeline-size model chunks; "
                   "--stage-end-weight W counts the embedding and the output layer as W blocks each")
_BATCH_RAMP = "batch-size ramp-up is not built: every step takes --global-batch-size samples"
_DECOUPLED_LR = ("not built: every parameter, the embedding included, follows --lr and --min-lr; "
                 "drop the flag")
_EVAL_BATCH = ("validation runs --eval-iters batches of --global-batch-size, in micro-batches of "
               "--micro-batch-size; drop the flag")
_ROPE_SCALING = ("RoPE frequency scaling (Llama 3.1's) is not built: positions rotate by "
                 "--rotary-base alone; drop the flag")
_TP_OVERLAP_PARTS = ("--tp-comm-overlap overlaps both the all-gather and the reduce-scatter, with no "
                     "switch for each; give --tp-comm-overlap or --no-tp-comm-overlap")
# Megatron flags without a field here, and what to do instead.
MEGATRON_ANSWERS: dict[str, str] = {
    "--use-flash-attn": _KERNELS, "--transformer-impl": _KERNELS,
    "--use-mcore-models": _ONE_MODEL,
    "--no-masked-softmax-fusion": _KERNELS, "--attention-softmax-in-fp32": _KERNELS,
    "--swiglu": _BLOCK, "--normalization": _BLOCK,
    "--position-embedding-type": _BLOCK, "--use-rotary-position-embeddings": _BLOCK,
    "--untie-embeddings-and-output-weights": _BLOCK, "--disable-bias-linear": _BLOCK,
    "--lr-warmup-fraction": "give the warm-up in steps with --lr-warmup-iters (Megatron's is the "
                            "fraction x --lr-decay-iters)",
    "--train-samples": "give the length in steps with --train-iters (samples = steps x "
                        "--global-batch-size)",
    "--lr-decay-samples": "give the decay length in steps with --lr-decay-iters",
    "--lr-warmup-samples": "give the warm-up in steps with --lr-warmup-iters",
    "--loss-scale": "fp16 uses a dynamic loss scaler: set its start with --initial-loss-scale",
    "--make-vocab-size-divisible-by": "the vocabulary is padded to a multiple of 128 x tp "
                                      "automatically; drop the flag",
    "--num-workers": "data is memory-mapped and read in the training process; drop the flag",
    "--data-impl": "data is always Megatron's memory-mapped indexed format; drop the flag",
    "--tensorboard-log-interval": "dashboards follow --log-interval",
    # FP8 (docs/precision.md)
    "--fp8": "gridtron spells it --fp8-format e4m3|hybrid (FP8 GEMMs on top of --bf16)",
    "--fp8-param-gather": "not built: parameters stay bf16 (fp32 masters) and are gathered in bf16; "
                          "the FP8 layers quantize each weight per call; drop the flag",
    "--fp8-amax-history-len": _DELAYED, "--fp8-amax-compute-algo": _DELAYED,
    "--fp8-margin": _DELAYED, "--fp8-interval": _DELAYED,
    "--no-fp8-wgrad": "under --fp8-format the weight-gradient GEMM runs in FP8 with the other two; "
                      "it has no switch of its own; drop the flag",
    "--fp8-dot-product-attention": _FP8_ATTENTION, "--fp8-multi-head-attention": _FP8_ATTENTION,
    "--fp4-format": _FP4, "--fp4": _FP4, "--fp4-param-gather": _FP4, "--fp4-recipe": _FP4,
    # ZeRO-3 and the optimizer offload (docs/data_parallel.md)
    "--use-torch-fsdp2": _FSDP, "--use-custom-fsdp": _FSDP, "--use-megatron-fsdp": _FSDP,
    "--torch-fsdp2-no-reshard-after-forward": "ZeRO-3 (--data-parallel-sharding-strategy "
                                              "optim_grads_params) frees each block's gathered "
                                              "parameters after its forward and gathers them again "
                                              "for its backward; for unsharded parameters use "
                                              "--data-parallel-sharding-strategy optim_grads "
                                              "(ZeRO-2)",
    "--use-precision-aware-optimizer": _PRECISION_AWARE, "--main-grads-dtype": _PRECISION_AWARE,
    "--main-params-dtype": _PRECISION_AWARE, "--exp-avg-dtype": _PRECISION_AWARE,
    "--exp-avg-sq-dtype": _PRECISION_AWARE,
    "--overlap-cpu-optimizer-d2h-h2d": _OFFLOAD_BUILT_IN, "--pin-cpu-grads": _OFFLOAD_BUILT_IN,
    "--pin-cpu-params": _OFFLOAD_BUILT_IN, "--use-torch-optimizer-for-cpu-offload": _OFFLOAD_BUILT_IN,
    "--cpu-offloading": _ACTIVATION_OFFLOAD, "--cpu-offloading-num-layers": _ACTIVATION_OFFLOAD,
    "--cpu-offloading-activations": _ACTIVATION_OFFLOAD,
    "--cpu-offloading-weights": _ACTIVATION_OFFLOAD,
    "--fine-grained-activation-offloading": _ACTIVATION_OFFLOAD,
    # mixture of experts (docs/moe.md, "Not built yet")
    "--moe-enable-deepep": _DEEPEP, "--moe-flex-dispatcher-backend": _DEEPEP,
    "--moe-permute-fusion": "the token permutation is one stable sort and gather on the device "
                            "(parallel/expert_parallel/permute.py), with nothing to fuse by a flag; "
                            "drop the flag",
    "--moe-router-fusion": "the router's scores and top-k run as plain fp32 ops, with no fused "
                           "kernel to choose; drop the flag",
    "--moe-router-dtype": "the router's logits and scores are always fp32; drop the flag",
    "--moe-use-legacy-grouped-gemm": "one grouped GEMM per device: --moe-grouped-gemm (the default) "
                                     "or --no-moe-grouped-gemm (a loop of per-expert GEMMs)",
    "--moe-token-drop-policy": "with --moe-expert-capacity-factor the lowest-weighted assignments "
                               "drop (Megatron's probs policy); the position policy is not built; "
                               "drop the flag",
    "--moe-shared-expert-overlap": "not built: the shared expert runs after the routed experts' "
                                   "combine, on the compute stream; drop the flag",
    "--moe-router-num-groups": _GROUP_ROUTING, "--moe-router-group-topk": _GROUP_ROUTING,
    "--moe-input-jitter-eps": "router input jitter is not built; drop the flag",
    "--moe-router-force-load-balancing": "not built (Megatron's benchmarking mode that routes by "
                                         "random logits); drop the flag",
    # pipeline and data-parallel layout (docs/running.md, "Coming from Megatron-LM")
    "--num-layers-per-virtual-pipeline-stage": "give the model chunks per pipeline stage instead: "
                                               "--virtual-pipeline-size num_layers / (--pp x L), "
                                               "which selects the interleaved schedule",
    "--pipeline-model-parallel-layout": "an explicit layout is not built: " + _PIPELINE_SPLIT,
    "--decoder-first-pipeline-num-layers": _PIPELINE_SPLIT,
    "--decoder-last-pipeline-num-layers": _PIPELINE_SPLIT,
    "--account-for-embedding-in-pipeline-split": _PIPELINE_SPLIT,
    "--account-for-loss-in-pipeline-split": _PIPELINE_SPLIT,
    "--ddp-bucket-size": "give the DP bucket in MiB of fp32 gradients: --bucket-size-mb N x 4 / 2^20 "
                         "(Megatron's 40000000 elements: 152.6)",
    "--distributed-timeout-minutes": "give it in seconds: --timeout-s 60 x M (default 300; "
                                     "Megatron's 10 minutes: 600)",
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated and reduced in fp32 already; "
                                            "drop the flag",
    "--grad-reduce-in-bf16": "not built: gradients are accumulated and reduced in fp32 "
                             "(--grad-compression int8 sends about a quarter of that); drop the flag",
    "--tp-comm-overlap-cfg": "--tp-comm-overlap takes no tuning file: it splits each GEMM's "
                             "all-gather or reduce-scatter into tp chunks on a ring; drop the flag",
    "--no-tp-comm-overlap-ag": _TP_OVERLAP_PARTS, "--no-tp-comm-overlap-rs": _TP_OVERLAP_PARTS,
    # recomputation
    "--recompute-method": _RECOMPUTE_LAYERS, "--recompute-num-layers": _RECOMPUTE_LAYERS,
    "--recompute-modules": "--recompute selective recomputes the attention core (Megatron's default "
                           "module, core_attn); other modules are not built: --recompute full "
                           "recomputes whole layers; drop the flag",
    # kernels and fusions
    "--attention-backend": _KERNELS, "--no-gradient-accumulation-fusion": _KERNELS,
    "--no-bias-gelu-fusion": _KERNELS, "--bias-gelu-fusion": _KERNELS,
    "--no-bias-swiglu-fusion": _KERNELS, "--bias-swiglu-fusion": _KERNELS,
    "--no-bias-dropout-fusion": _KERNELS, "--no-rope-fusion": _KERNELS,
    "--cross-entropy-loss-fusion": _KERNELS, "--cross-entropy-fusion-impl": _KERNELS,
    "--no-persist-layer-norm": _KERNELS, "--no-gradient-reduce-div-fusion": _KERNELS,
    # model shape
    "--use-legacy-models": _ONE_MODEL,
    "--no-position-embedding": _BLOCK,
    "--kv-channels": "the head width is --hidden-size / --num-attention-heads; another is not built; "
                     "drop the flag",
    "--rotary-percent": "rotary embeddings rotate the whole head (Megatron's 1.0); a partial rotation "
                        "is not built; drop the flag",
    "--rotary-interleaved": "rotary embeddings rotate the two halves of each head (x cos + "
                            "rotate_half(x) sin, Megatron's default); the interleaved pairing is not "
                            "built; drop the flag",
    "--use-rope-scaling": _ROPE_SCALING, "--rope-scaling-factor": _ROPE_SCALING,
    "--apply-layernorm-1p": "zero-centred norm weights (Megatron's 1p) are not built: each norm "
                            "multiplies by its weight, initialised to 1; drop the flag",
    "--apply-query-key-layer-scaling": "attention scores are scaled by 1/sqrt(head width) alone, with "
                                       "no per-layer factor (a device of Megatron's fp16 softmax); "
                                       "drop the flag",
    "--mtp-num-layers": "multi-token prediction is not built; drop the flag",
    "--use-cpu-initialization": "weights are always drawn on the host, each in its full serial shape "
                                "from --seed and its name, then sliced: the same model under every "
                                "layout; drop the flag",
    # training
    "--optimizer": "the only optimizer is AdamW (Megatron's adam: decoupled weight decay); drop the "
                   "flag",
    "--lr-warmup-init": "not built: the warm-up starts at --lr / --lr-warmup-iters and rises "
                        "linearly to --lr (docs/running.md); drop the flag",
    "--lr-wsd-decay-style": _WSD, "--lr-wsd-decay-iters": _WSD, "--lr-wsd-decay-samples": _WSD,
    "--decoupled-lr": _DECOUPLED_LR, "--decoupled-min-lr": _DECOUPLED_LR,
    "--rampup-batch-size": _BATCH_RAMP, "--step-batch-size-schedule": _BATCH_RAMP,
    "--calculate-per-token-loss": "the loss is always the mean over the loss tokens of the whole "
                                  "global batch (Megatron's per-token loss); drop the flag",
    "--exit-interval": _EXIT, "--exit-duration-in-mins": _EXIT,
    "--exit-signal-handler": "SIGTERM always makes the run save (with --save) and stop after its "
                             "current step; drop the flag",
    "--check-for-nan-in-loss-and-grad": "always on: a non-finite loss stops the run and a non-finite "
                                        "gradient norm skips the step (under fp16, the loss "
                                        "scaler's overflow); --rerun-on-anomaly re-runs such a step "
                                        "once and names the rank and parameter; drop the flag",
    "--no-check-for-nan-in-loss-and-grad": "the check for a non-finite loss or gradient norm cannot "
                                           "be turned off (it needs no collective of its own); drop "
                                           "the flag",
    "--train-sync-interval": "the host waits for the device once per step (for the step's loss and "
                             "gradient norm), so it never runs far ahead; drop the flag",
    "--manual-gc": "Python's garbage collector is left to run as usual; drop the flag",
    "--eval-global-batch-size": _EVAL_BATCH, "--eval-micro-batch-size": _EVAL_BATCH,
    # data
    "--data-cache-path": "the sample order is computed in memory at start, with no cache files; "
                         "drop the flag",
    "--dataloader-type": "gridtron's sampler draws global batch k from reshuffled epochs seeded by "
                         "--seed (the same under every layout); drop the flag",
    "--no-mmap-bin-files": "prepared data is always memory-mapped; drop the flag",
    "--no-create-attention-mask-in-dataloader": "the data loader builds no attention mask: attention "
                                                "is causal in the kernels (within each document "
                                                "with --reset-attention-mask); drop the flag",
    # checkpoints
    "--ckpt-format": _CKPT, "--use-dist-ckpt": _CKPT, "--auto-detect-ckpt-format": _CKPT,
    "--save-retain-interval": "not built: gridtron keeps the newest --keep-last checkpoints (default "
                              "2) and deletes older ones; give --keep-last at least the number of "
                              "saves to keep every one",
    "--no-save-optim": "checkpoints always hold the optimizer state; to start from one without it, "
                       "load with --finetune (weights only) or --no-load-optim; drop the flag",
    "--exit-on-missing-checkpoint": "a --load that holds no checkpoint always stops the run with one "
                                    "line (except --load DIR --save DIR on an empty DIR: a first "
                                    "run); drop the flag",
    # logging
    "--log-throughput": "metrics.jsonl and the dashboards always carry the throughput (tokens_per_s, "
                        "tflops_per_device, mfu); drop the flag",
    "--log-timers-to-tensorboard": "metrics.jsonl always carries the step's timers (step_time_s, "
                                   "time_*_s) and the dashboards its step time and exposed "
                                   "communication; drop the flag",
    "--log-validation-ppl-to-tensorboard": "the dashboards carry the validation loss (valid/loss; the "
                                           "perplexity is its exp); drop the flag",
    "--log-memory-to-tensorboard": "metrics.jsonl and the dashboards always carry the peak memory "
                                   "(peak_memory_bytes); drop the flag",
    "--log-params-norm": "not built: metrics.jsonl carries the gradient norm (grad_norm), not the "
                         "parameters'; drop the flag",
    "--log-num-zeros-in-grad": "not built; drop the flag",
    "--log-world-size-to-tensorboard": "not built; drop the flag",
    "--log-progress": "not built: metrics.jsonl records every step's tokens and time, and --progress "
                      "shows a progress bar; drop the flag",
    "--tensorboard-queue-size": "the TensorBoard writer keeps its own queue; drop the flag",
    "--timing-log-level": "metrics.jsonl records every step's timers (time_*_s) at one level; drop "
                          "the flag",
    "--profile": _PROFILE, "--profile-step-start": _PROFILE, "--profile-step-end": _PROFILE,
    "--use-pytorch-profiler": _PROFILE, "--profile-ranks": _PROFILE,
    "--wandb-entity": "set the WANDB_ENTITY environment variable (wandb reads it); --wandb-project "
                      "names the project",
}

# Megatron values of a real flag that gridtron does not build: the choice error says why.
CHOICE_ANSWERS: dict[str, dict[str, str]] = {
    "fp8_recipe": {"delayed": _DELAYED.replace("; drop the flag", ""),
                   "mxfp8": "MXFP8 (32-element blocks) is not built"},
    "moe_token_dispatcher_type": {
        "flex": _DEEPEP.replace("; drop the flag", ""),
        "alltoall_seq": "Megatron-LM's alltoall_seq (its older alltoall, since removed) is alltoall "
                        "here: write --moe-token-dispatcher-type alltoall"},
    "lr_decay_style": {
        "WSD": _WSD,
        "inverse-square-root": "inverse-square-root decay is not built: the decay reaches --min-lr "
                               "at --lr-decay-iters (cosine or linear)"},
    "cp_comm_type": {
        "a2a+p2p": "hierarchical context parallelism (a2a inside a group, p2p across groups) is not "
                   "built: choose p2p (ring) or a2a (Ulysses) for the whole --cp group",
        "allgather": "the all-gather of K/V is not built: p2p (ring attention) passes the K/V "
                     "blocks around the --cp group instead"},
    "moe_router_load_balancing_type": {
        "global_aux_loss": "aux_loss here is the global one: write --moe-router-load-balancing-type "
                           "aux_loss (counts over each micro-step's tokens of all DP x CP ranks, "
                           "not averaged over the step's micro-batches; docs/moe.md)",
        "sinkhorn": "Sinkhorn routing is not built: balance with aux_loss or seq_aux_loss (and "
                    "--moe-aux-loss-coeff), or without a loss by --moe-router-enable-expert-bias"},
}
