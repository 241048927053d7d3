"""Answers to Megatron-LM flags and values that gridtron does not build: ``MEGATRON_ANSWERS`` for a
flag with no field here (what to do instead, in one line), ``CHOICE_ANSWERS`` for a Megatron value
of a real flag (``--fp8-recipe delayed``). A user typing from habit learns the gridtron way instead
of argparse's "unknown argument" (engine/config/cli.py, recipe.py). Neither may name a flag that
does not exist, and ``MEGATRON_ANSWERS`` no flag that does (tests/engine/config/test_cli.py)."""
from __future__ import annotations

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
_OWN_DATA_SPLITS = ("separate validation or test data is not built: --split W_TRAIN,W_VALID,W_TEST "
                    "takes them from --data-path's documents (a seeded shuffle of whole documents, "
                    "never trained on); drop the flag")
_P2P_OVERLAP = ("pipeline transfers are always posted without waiting, and each is waited for only by "
                "the compute step that consumes it (parallel/pipeline/exchange.py), under every "
                "schedule; drop the flag")
_SAVE_SPREAD = ("each rank writes its own slices at once; a tensor replicated over data parallelism "
                "is written once, by DP rank 0 (the distributed optimizer's state, and ZeRO-3's "
                "parameters, by every rank of the DP x CP group, each its own shard); spreading "
                "the replicated ones over the DP ranks is not built; drop the flag")
_LR_FROM_FLAGS = ("the learning rate follows this run's --lr, --min-lr, --lr-warmup-iters, "
                  "--lr-decay-style and --lr-decay-iters, at the step loaded from --load")
_SCHEDULE_FROM_CHECKPOINT = ("the schedule is never taken from the checkpoint: " + _LR_FROM_FLAGS
                             + "; give the saved run's values to continue its schedule, and drop "
                             "the flag")
_SCHEDULE_OVERRIDDEN = "always so: " + _LR_FROM_FLAGS + "; drop the flag"
_LOG_LR = ("metrics.jsonl and the dashboards always carry the learning rate (lr, train/lr), with no "
           "switch; drop the flag")
_LOG_LOSS_SCALE = ("metrics.jsonl and the dashboards always carry the loss scale (loss_scale, "
                   "train/loss_scale; 1.0 outside --fp16), with no switch; drop the flag")
_LOCAL_RANK = ("the local rank is read from the environment (LOCAL_RANK, which torchrun sets; "
               "SLURM_LOCALID under srun): launch with torchrun; drop the flag")
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
    "--moe-router-topk-scaling-factor": "not built: each chosen expert's weight is its router score "
                                        "as --moe-router-score-function gives it, with no further "
                                        "factor; drop the flag",
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
    "--overlap-p2p-communication": _P2P_OVERLAP, "--no-overlap-p2p-communication": _P2P_OVERLAP,
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
    "--fp32-residual-connection": "an fp32 residual stream is not built: the residual stream has the "
                                  "dtype of the other activations (--precision's: bf16 under --bf16); "
                                  "drop the flag",
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
    "--empty-unused-memory-level": "the device allocator's cache is never emptied during the run "
                                   "(Megatron's level 0, its default); drop the flag",
    "--rerun-mode": "give --rerun-on-anomaly to re-run a step with a non-finite or spiking loss or "
                    "gradient norm once from its saved inputs (Megatron's validate_results; "
                    "--spike-factor sets what a spike is), or nothing (disabled, the default here); "
                    "report_stats is not built",
    "--deterministic-mode": "a deterministic mode is not built: torch's default kernels run, and on "
                            "a GPU some are not bitwise reproducible from run to run; drop the flag",
    "--use-checkpoint-opt_param-scheduler": _SCHEDULE_FROM_CHECKPOINT,
    "--use-checkpoint-opt-param-scheduler": _SCHEDULE_FROM_CHECKPOINT,
    "--override-opt_param-scheduler": _SCHEDULE_OVERRIDDEN,
    "--override-opt-param-scheduler": _SCHEDULE_OVERRIDDEN,
    "--local-rank": _LOCAL_RANK, "--local_rank": _LOCAL_RANK,
    "--eval-global-batch-size": _EVAL_BATCH, "--eval-micro-batch-size": _EVAL_BATCH,
    # data
    "--data-cache-path": "the sample order is computed in memory at start, with no cache files; "
                         "drop the flag",
    "--dataloader-type": "gridtron's sampler draws global batch k from reshuffled epochs seeded by "
                         "--seed (the same under every layout); drop the flag",
    "--no-mmap-bin-files": "prepared data is always memory-mapped; drop the flag",
    "--train-data-path": "give the training data with --data-path (a prefix or a weighted blend, the "
                         "same syntax); --split assigns its documents to training, validation and "
                         "test (--split 1,0,0 trains on all of them); separate validation or test "
                         "data is not built",
    "--valid-data-path": _OWN_DATA_SPLITS, "--test-data-path": _OWN_DATA_SPLITS,
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
    "--no-save-rng": "checkpoints always hold each rank's random states (the host's, the device's "
                     "and the dropout streams); to start from one without them, load with "
                     "--no-load-rng; drop the flag",
    "--ckpt-fully-parallel-save": _SAVE_SPREAD, "--no-ckpt-fully-parallel-save": _SAVE_SPREAD,
    "--ckpt-fully-parallel-load": "each rank reads straight from the files only the parts of the "
                                  "tensors its own shards cover (the files' verification shared "
                                  "among the ranks); drop the flag",
    "--dist-ckpt-strictness": "a parameter that the checkpoint lacks, or holds in another shape, "
                              "stops the load with one line naming it; there is no looser mode; "
                              "drop the flag",
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
    "--log-learning-rate-to-tensorboard": _LOG_LR, "--no-log-learning-rate-to-tensorboard": _LOG_LR,
    "--log-loss-scale-to-tensorboard": _LOG_LOSS_SCALE,
    "--no-log-loss-scale-to-tensorboard": _LOG_LOSS_SCALE,
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
