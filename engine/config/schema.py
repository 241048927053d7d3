"""Typed run configuration: one small dataclass per concern, each validated in __post_init__.

``RunConfig`` bundles them for the trainer; layers only ever see the piece they need (GPTConfig,
LayerContext), never the whole run configuration.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from engine.config.parallel import ParallelConfig
from engine.config.fp8 import check_fp8_flags
from engine.config.sharding import check_sharding_flags
from models.config import GPTConfig, check_finite
from parallel.grid.expert_groups import ExpertGrid

PRECISIONS = ("fp32", "bf16", "fp16")
# the torch dtype of each --precision (the model, its parameters and activations)
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8_FORMATS = ("e4m3", "hybrid")       # kernels/fp8.py FORMATS
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")  # kernels/fp8.py RECIPES
COMPRESSORS = ("none", "int8", "topk", "onebit")
DECAY_STYLES = ("cosine", "linear", "constant")
DEVICES = ("auto", "npu", "cuda", "cpu")
WANDB_MODES = ("online", "offline", "disabled")


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``"3-5"`` -> (3, 5); ``"4"`` -> (4, 4); None -> None. Steps are 1-based."""
    if text is None or str(text).strip() == "":
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", str(text))
    if not match:
        raise ValueError(f"--profile-steps takes A-B (steps A to B, 1-based), e.g. 3-5, got {text!r}")
    first, last = int(match.group(1)), int(match.group(2) or match.group(1))
    if first < 1 or last < first:
        raise ValueError(f"--profile-steps {text}: need 1 <= A <= B")
    return first, last


@dataclass
class OptimConfig:
    train_iters: int = 100
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 10
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None  # default: train_iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # bad steps (engine/observe/anomaly.py): a non-finite or spiking loss or gradient norm is caught before
    # the update; with rerun_on_anomaly the step runs again once from its saved inputs
    rerun_on_anomaly: bool = False
    spike_factor: float = 0.0   # a value above this x the running median is a spike (0: off)
    spike_window: int = 32      # steps in that running median
    # the distributed optimizer's masters and moments in host memory, updated there
    # (parallel/dp/offload.py); the fraction of this rank's shard elements offloaded
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0

    def __post_init__(self):
        check_finite(self)
        if self.spike_factor != 0 and self.spike_factor <= 1:
            raise ValueError(f"--spike-factor must be above 1 (or 0: off), got {self.spike_factor}; "
                             f"a spike is a value above that many times the running median")
        if self.spike_window < 1:
            raise ValueError(f"--spike-window must be >= 1, got {self.spike_window}")
        if self.train_iters < 1:
            raise ValueError(f"--train-iters must be >= 1, got {self.train_iters}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be cosine, linear or constant, got {self.lr_decay_style!r}")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(f"--lr-decay-iters {self.lr_decay_iters} must be above --lr-warmup-iters "
                             f"{self.lr_warmup_iters}")
        if self.lr_warmup_iters < 0 or self.clip_grad < 0 or self.weight_decay < 0:
            raise ValueError("--lr-warmup-iters, --clip-grad and --weight-decay must be >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(f"--adam-beta1 and --adam-beta2 must be in [0, 1), got "
                             f"{self.adam_beta1} and {self.adam_beta2}")
        if not self.adam_eps > 0:
            raise ValueError(f"--adam-eps must be > 0 (it keeps AdamW's division finite where the "
                             f"second moment is 0), got {self.adam_eps}")


@dataclass
class PrecisionConfig:
    precision: str = "fp32"
    initial_loss_scale: float = 1024.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # help: let fp32 matmuls run on TF32 (NVIDIA) / HF32 (Ascend) units; MFU then divides by the
    # TF32/HF32 peak instead of the plain fp32 one
    allow_tf32: bool = False
    # FP8 GEMMs in the tensor-parallel layers on top of bf16 (docs/precision.md): e4m3 (every
    # operand) or hybrid (e5m2 gradients); None: off
    fp8_format: str | None = None
    fp8_recipe: str = "tensorwise"   # tensorwise | rowwise | blockwise scales
    first_last_layers_bf16: bool = False  # keep the first and last layers in bf16 (counts below)
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    def __post_init__(self):
        check_finite(self)
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.initial_loss_scale <= 0 or self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError("--initial-loss-scale must be > 0, --loss-scale-window and --hysteresis >= 1")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale "
                             f"{self.initial_loss_scale:g}], got {self.min_loss_scale:g}")
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"--fp8-format must be one of {FP8_FORMATS}, got {self.fp8_format!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")
        if self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0:
            raise ValueError("--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 must be >= 0")
        if self.fp8_format is not None and self.precision != "bf16":
            raise ValueError(f"--fp8-format {self.fp8_format} runs FP8 GEMMs on top of bf16 "
                             f"(fp32 masters, bf16 everywhere else), not with --precision "
                             f"{self.precision}: add --bf16, or drop --fp8-format")

    @property
    def fp8_bf16_layers(self) -> tuple[int, int]:
        """(first, last) layers kept in bf16 under FP8."""
        if not self.first_last_layers_bf16:
            return 0, 0
        return self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16


@dataclass
class DataConfig:
    data_path: list[str] | None = None  # [PREFIX], or Megatron's blend [W1, PREFIX1, W2, PREFIX2, ...]
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer: str = "bpe:8192"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    micro_batch_size: int = 4
    global_batch_size: int = 16
    cache_dir: str | None = None
    # help: packed documents: each token attends only to earlier tokens of its own document (the
    # end-of-document token closes a document), as Megatron-LM's --reset-attention-mask
    reset_attention_mask: bool = False
    # help: packed documents: positions restart at 0 after every end-of-document token (learned
    # position embeddings and RoPE alike), as Megatron-LM's --reset-position-ids
    reset_position_ids: bool = False
    # help: drop the loss where the input is the end-of-document token (its target starts the next
    # document); the loss is the mean over the remaining tokens of the global batch
    eod_mask_loss: bool = False

    def __post_init__(self):
        from engine.data.blend import parse_data_path
        from engine.data.splits import parse_split
        if isinstance(self.data_path, str):
            self.data_path = self.data_path.split()
        if self.data_path is not None:
            self.data_path = [str(p) for p in self.data_path]
            parse_data_path(self.data_path)
        parse_split(self.split)
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError("--micro-batch-size and --global-batch-size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"--global-batch-size {self.global_batch_size} is not a multiple of "
                             f"--micro-batch-size {self.micro_batch_size}")

    def num_microbatches(self, dp: int) -> int:
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by micro-batch-size x "
                f"dp = {self.micro_batch_size} x {dp}; choose a global batch that is a multiple of "
                f"{self.micro_batch_size * dp}")
        return self.global_batch_size // (self.micro_batch_size * dp)


@dataclass
class CompressionConfig:
    grad_compression: str = "none"
    grad_compression_ratio: float = 0.01
    grad_compression_policy: dict | None = None
    # help: optimizer steps that exchange uncompressed gradients before --grad-compression starts
    # (default: --grad-compression-warmup-fraction of the run for onebit and topk, 4 for int8)
    grad_compression_warmup_steps: int | None = None
    # help: the warm-up as a fraction of --train-iters (onebit, topk; 1-bit Adam uses 0.15-0.25)
    grad_compression_warmup_fraction: float = 0.15
    # help: onebit, topk: when Adam's frozen second moment is refreshed from the DP ranks' local
    # squared gradients: exp (0/1 Adam: 1, 2, 4, 8, ... steps after the warm-up), K steps, off,
    # or auto (off)
    grad_compression_variance_refresh: str = "auto"
    # help: topk: compressed steps over which the fraction sent falls from 0.25 to the ratio
    # (Deep Gradient Compression's sparsity warm-up; default 0.2 of --train-iters)
    grad_compression_sparsity_warmup_steps: int | None = None

    def __post_init__(self):
        check_finite(self)
        if self.grad_compression not in COMPRESSORS:
            raise ValueError(f"--grad-compression must be one of {COMPRESSORS}, got {self.grad_compression!r}")
        if not 0.0 < self.grad_compression_ratio <= 1.0:
            raise ValueError(f"--grad-compression-ratio must be in (0, 1], got {self.grad_compression_ratio}")
        if self.grad_compression_warmup_steps is not None and self.grad_compression_warmup_steps < 0:
            raise ValueError("--grad-compression-warmup-steps must be >= 0")
        if self.grad_compression_sparsity_warmup_steps is not None \
                and self.grad_compression_sparsity_warmup_steps < 0:
            raise ValueError("--grad-compression-sparsity-warmup-steps must be >= 0 (0: no ramp)")
        if not 0.0 <= self.grad_compression_warmup_fraction < 1.0:
            raise ValueError(f"--grad-compression-warmup-fraction must be in [0, 1), got "
                             f"{self.grad_compression_warmup_fraction}")
        refresh = str(self.grad_compression_variance_refresh).strip().lower()
        if refresh not in ("auto", "exp", "off") and not refresh.isdigit():
            raise ValueError(f"--grad-compression-variance-refresh must be auto, exp, off or a number of "
                             f"steps >= 0, got {self.grad_compression_variance_refresh!r}")
        if self.grad_compression in ("topk", "onebit") and self.grad_compression_warmup_steps == 0:
            raise ValueError(f"--grad-compression {self.grad_compression} needs "
                             "--grad-compression-warmup-steps >= 1: Adam's second moment of the "
                             "compressed parameters comes from the uncompressed warm-up steps")
        if self.grad_compression in ("topk", "onebit") and self.grad_compression_warmup_steps is None \
                and self.grad_compression_warmup_fraction == 0:
            raise ValueError(f"--grad-compression {self.grad_compression} needs "
                             "--grad-compression-warmup-fraction > 0 (or --grad-compression-warmup-"
                             "steps >= 1): Adam's second moment of the compressed parameters comes "
                             "from the uncompressed warm-up steps")


@dataclass
class CheckpointConfig:
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    keep_last: int = 2
    finetune: bool = False
    load_optim: bool = True
    load_rng: bool = True
    use_checkpoint_args: bool = False
    async_save: bool = False  # copy shards to host at the step boundary, write them in the background
    overwrite: bool = False   # a fresh run may replace another run's checkpoints in --save (moved aside first)

    def __post_init__(self):
        # an empty --load= (a recipe's checkpoint cleared on the command line): nothing to load
        # (an empty --save= already means no checkpoints, not the --run-dir default)
        self.load = self.load or None
        if self.save_interval < 0 or self.keep_last < 1:
            raise ValueError("--save-interval must be >= 0 and --keep-last >= 1")
        for flag, on in (("--finetune", self.finetune), ("--use-checkpoint-args", self.use_checkpoint_args)):
            if on and not self.load:
                raise ValueError(f"{flag} reads the checkpoint given by --load, and there is none: "
                                 f"add --load DIR, or drop {flag}")


@dataclass
class LogConfig:
    run_dir: str | None = None
    metrics_file: str | None = None  # default RUN_DIR/metrics.jsonl
    timeline: str | None = None      # default RUN_DIR/timeline.json
    plot: str | None = None          # default RUN_DIR/loss.png
    log_interval: int = 10
    # where counting the step's host waits costs host time (the dispatch mode: devices without a
    # runtime report of their own, CPU and NPU): count on step 1 and every N-th; None: --log-interval
    host_sync_interval: int | None = None
    log_straggler: bool = True  # every log_interval steps, name the ranks the others waited for
    straggler_threshold: float = 1.2  # a rank is a straggler past this ratio over its peers' compute
    eval_interval: int = 0
    eval_iters: int = 4
    progress: bool = True
    peak_tflops: float | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_mode: str = "online"
    # help: optimizer steps A-B (1-based) recorded by torch.profiler (ops, shapes, memory) into
    # --profile-dir, default <run-dir>/profile
    profile_steps: str | None = None
    profile_dir: str | None = None

    def __post_init__(self):
        check_finite(self)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0 (or unset: from the hardware table), got "
                             f"{self.peak_tflops}")
        if self.eval_interval < 0 or self.eval_iters < 1:
            raise ValueError("--eval-interval must be >= 0 and --eval-iters >= 1")
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.host_sync_interval is not None and self.host_sync_interval < 1:
            raise ValueError(f"--host-sync-interval must be >= 1 (1: every step), got "
                             f"{self.host_sync_interval}")
        if not self.straggler_threshold > 1.0:
            raise ValueError(f"--straggler-threshold must be above 1.0 (a ratio over the peers' compute), "
                             f"got {self.straggler_threshold}")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"--wandb-mode must be one of {WANDB_MODES}, got {self.wandb_mode!r}")
        if self.profile_steps is not None:
            parse_steps(self.profile_steps)
        if self.run_dir:
            for key, name in RUN_DIR_FILES.items():
                if getattr(self, key) is None:
                    setattr(self, key, os.path.join(self.run_dir, name))

    @property
    def compile_cache_root(self) -> str:
        return self.run_dir or "runs/latest"


RUN_DIR_FILES = {"metrics_file": "metrics.jsonl", "timeline": "timeline.json", "plot": "loss.png"}


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    device: str = "auto"
    compile: bool = False
    seed: int = 1234
    explicit: tuple[str, ...] = ()  # the keys a user set (flags or recipe), filled in by engine.config.cli

    def __post_init__(self):
        if self.log.run_dir and self.checkpoint.save is None:
            self.checkpoint.save = os.path.join(self.log.run_dir, "checkpoints")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.seed < 0:  # numpy's and the dropout streams' generators take non-negative seeds
            raise ValueError(f"--seed must be >= 0, got {self.seed}; give a non-negative integer")
        if self.parallel.tp_comm_overlap and not self.parallel.sequence_parallel \
                and self.device != "npu":
            raise ValueError("--tp-comm-overlap needs --sequence-parallel (it overlaps the "
                             "sequence-parallel all-gather and reduce-scatter with the GEMMs; "
                             "without it only Ascend's fused matmul-all-reduce has something to "
                             "overlap, with --device npu); add --sequence-parallel or drop "
                             "--tp-comm-overlap")
        if not (self.checkpoint.use_checkpoint_args and self.checkpoint.load
                and self.model.num_experts is None):  # else checked with the checkpoint's model
            check_expert_flags(self.model, self.parallel)
        check_fp8_flags(self)
        check_sharding_flags(self)


def check_expert_flags(model: GPTConfig, parallel: ParallelConfig) -> None:
    """The expert flags against the model's experts and what this slice builds (dp is checked by
    ``grid``); docs/moe.md lists what is not built yet."""
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    if etp not in (1, parallel.tp):
        change = f"raise --tp to {etp} or drop the flag" if parallel.tp == 1 else \
            f"give 1 or {parallel.tp}"
        raise ValueError(f"--expert-tensor-parallel-size {etp}: only 1 (each expert whole on one "
                         f"rank) or --tp {parallel.tp} (the TP group splits every expert) is built; "
                         f"{change}")
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if model.num_experts is None:
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} splits mixture-of-experts layers, "
                             f"which need --num-experts E; add it or use 1")
        return
    ExpertGrid.local_experts(model.num_experts, ep, 0)
    if etp > 1 and model.moe_ffn_hidden_size % etp:
        raise ValueError(f"--moe-ffn-hidden-size {model.moe_ffn_hidden_size} is not divisible by "
                         f"--expert-tensor-parallel-size {etp}; choose a multiple of it")
