"""Shapes, layouts and topology rules: what the planner (search.py) ranks (memory.py: the bytes).

Pure arithmetic, no torch. Every constant is named in constants.py (re-exported here) and
explained in docs/planner.md; the one fitted constant is DEFAULT_ACHIEVABLE_FRACTION. Placement
follows the run's rank order (``Layout.order``, docs/design.md's ``tp-cp-dp-pp`` by default; see
placement.py): TP must stay inside a node, every other group is priced on the links its ranks
span (timing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.plan.flops import BLOCKS, RECOMPUTE, MoEShape, default_ffn_hidden
from engine.plan.hardware import OVERLAP_EFFICIENCY, DeviceSpec, OverlapEfficiency
from engine.plan.moe_layout import (check_moe_layout, moe_expert_rows, moe_expert_tokens,  # noqa: F401
                                     moe_tokens)
from engine.plan.placement import DEFAULT_ORDER, all_groups_intra, parse_order
from engine.plan.constants import (  # noqa: F401 (re-exported: the planner's constants)
    GIB, MAX_DEVICES, PLAN_PRECISION, PLAN_SCHEDULES, WEIGHT_BYTES, GRAD_BYTES,
    OPTIMIZER_STATE_BYTES, BYTES_PER_PARAM, ZERO1_REPLICATED_BYTES, ZERO1_SHARDED_BYTES,
    ACT_BYTES, MEMORY_USABLE_FRACTION, HCCL_BUFFSIZE_MB, P2P_HCCL_BUFFSIZE_MB,
    NCCL_BUFFSIZE_BYTES, NCCL_CHANNELS_ASSUMED, COMM_BUFFER_BYTES, P2P_BUFFER_BYTES,
    DEFAULT_ACHIEVABLE_FRACTION, FIT_ROW, HBM_EFFICIENCY, LINK_EFFICIENCY, COLLECTIVE_LATENCY_S,
    LAYER_PASS_OVERHEAD_S, OPTIMIZER_BYTES_PER_PARAM, DEFAULT_GRAD_BUCKET_BYTES, EW_REPLICATED,
    EW_SHARDED_ATTN, EW_MLP, EW_SCORES, ACT_MASK_BYTES, ACT_TENSORS_REPLICATED,
    ACT_TENSORS_SPLIT_ATTN, ACT_TENSORS_MLP, ACT_MOE_ROWS, ACT_MOE_FP32_PER_EXPERT,
    ACT_MOE_INDEX_BYTES, ACT_MOE_GATHERED_INDEX_BYTES, EW_MOE_PERMUTE, EW_MOE_RESORT,
    MOE_PASS_OVERHEAD_S, HOST_WAIT_S,
    VOCAB_PAD_MULTIPLE, HOST_ADAM_BYTES_PER_PARAM, HOST_CAST_BYTES_PER_PARAM, HOST_GRAD_BYTES,
    HOST_MEMORY_EFFICIENCY)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    global_batch_size: int
    ffn_hidden_size: int | None = None
    block: str = "gpt2"
    # Flash-style attention (gridtron's kernels; the CLI's default) keeps no s x s scores: no 5as/h
    # activation term and no score traffic. False models Megatron 2021's materialised softmax, as
    # Korthikanti et al. do.
    fused_attention: bool = False
    # Full recomputation under torch.utils.checkpoint's early stop (this engine) skips each layer's
    # last matrix multiply (the MLP's down projection) and the collective after it; False models
    # Megatron-LM's CheckpointFunction, which reruns the whole forward (flops.py).
    recompute_early_stop: bool = True
    # Bytes per activation element (2: bf16/fp16; 4: an fp32 run) and whether dropout keeps masks
    # (dropout 0, as in Llama recipes, keeps none: no masks, no dropout outputs of the scores).
    activation_bytes: int = ACT_BYTES
    dropout: bool = True
    # Whether the attention probabilities have dropout (--attention-dropout, default --dropout):
    # ring attention (cp > 1, the p2p ring the planner prices) applies none, so engine.train
    # refuses cp > 1 with it (check_layout)
    attention_dropout: bool = False
    # Key/value head groups of grouped-query attention (None: one per head, plain multi-head).
    num_query_groups: int | None = None
    # Bytes per weight: 2 (bf16/fp16, with fp32 masters in the optimizer) or 4 (an fp32 run, whose
    # weights are their own masters).
    weight_bytes: int = WEIGHT_BYTES
    # Mixture of experts (docs/moe.md): the MoE layers' shape (flops.MoEShape: experts, top-k,
    # expert and shared-expert widths) and the global indices of the layers whose MLP is an MoE
    # layer (``--moe-layer-freq``; every layer when left empty and ``moe.layers`` is num_layers).
    moe: MoEShape | None = None
    moe_layers: tuple[int, ...] = ()
    # --fp8-recipe of an FP8 run (None: no --fp8-format): the tensor-parallel linears' GEMMs at the
    # FP8 rate, their float8 copies and scales in memory (engine/plan/fp8.py, docs/precision.md)
    fp8_recipe: str | None = None
    # --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 of an FP8 run (is_fp8)
    fp8_bf16_layers: tuple[int, int] = (0, 0)
    # --max-position-embeddings: the rows of gpt2's learned position table (None: seq_length)
    max_positions: int | None = None
    # --qk-layernorm: a norm of head_dim on the queries and one on the keys of every layer,
    # replicated on the TP ranks, whose gradients (partial: each rank normed its own heads) are
    # summed over TP once per step
    qk_layernorm: bool = False
    # engine.train's rules that need its configuration (this package may not import it), each
    # Layout -> why it is refused or None, applied by check_layout after the planner's own: the
    # command line gives blockwise FP8's tile rule (engine/tools/plan_cli.py ``train_rules``)
    rules: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                    "global_batch_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be a positive integer, "
                                 f"got {getattr(self, key)!r}")
        if self.block not in BLOCKS:
            raise ValueError(f"--block must be one of {BLOCKS} for planning, got {self.block!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden(self.hidden_size, self.block))
        if self.max_positions is None:
            object.__setattr__(self, "max_positions", self.seq_length)
        if not isinstance(self.max_positions, int) or self.max_positions < self.seq_length:
            raise ValueError(f"--max-position-embeddings must be an integer >= --seq-length "
                             f"{self.seq_length}, got {self.max_positions!r}")
        if self.activation_bytes not in (1, 2, 4):
            raise ValueError(f"activation_bytes must be 1, 2 or 4, got {self.activation_bytes!r}")
        if self.weight_bytes not in (2, 4):
            raise ValueError(f"weight_bytes must be 2 or 4, got {self.weight_bytes!r}")
        if self.fp8_recipe not in (None, "tensorwise", "rowwise", "blockwise"):
            raise ValueError(f"fp8_recipe must be None, tensorwise, rowwise or blockwise, got "
                             f"{self.fp8_recipe!r}")
        if len(self.fp8_bf16_layers) != 2 or min(self.fp8_bf16_layers) < 0:
            raise ValueError(f"fp8_bf16_layers must be two counts >= 0, got {self.fp8_bf16_layers!r}")
        g = self.num_query_groups
        if g is not None and (not isinstance(g, int) or g < 1 or self.num_attention_heads % g):
            raise ValueError(f"--num-query-groups {g!r} must be a positive divisor of "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.moe is None:
            if self.moe_layers:
                raise ValueError("moe_layers without a MoEShape: give --num-experts")
            return
        if not self.moe_layers and self.moe.layers == self.num_layers:
            object.__setattr__(self, "moe_layers", tuple(range(self.num_layers)))
        layers = tuple(sorted(set(self.moe_layers)))
        if len(layers) != self.moe.layers or layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ValueError(f"moe_layers {self.moe_layers} must name the {self.moe.layers} MoE "
                             f"layers among the {self.num_layers} layers")
        object.__setattr__(self, "moe_layers", layers)

    @property
    def kv_hidden(self) -> int:
        """Width of the key (and of the value) projection: query groups x head size."""
        groups = self.num_query_groups or self.num_attention_heads
        return groups * (self.hidden_size // self.num_attention_heads)

    def is_fp8(self, layer: int) -> bool:
        """Whether global layer ``layer``'s tensor-parallel linears run in FP8."""
        first, last = self.fp8_bf16_layers
        return self.fp8_recipe is not None and first <= layer < self.num_layers - last

    def is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` has an MoE MLP."""
        return layer in self.moe_layers

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary as the engine allocates it: a multiple of 128 x tp (its padding rows are
        zero; parallel.tensor_parallel.padded_vocab_size)."""
        step = VOCAB_PAD_MULTIPLE * tp
        return -(-self.vocab_size // step) * step


def backend_of(device_name: str) -> str:
    """The collective backend of a device spec's name: hccl (Ascend), gloo (CPU), else nccl."""
    return "hccl" if device_name.startswith("ascend") else "gloo" if device_name == "cpu" else "nccl"


@dataclass(frozen=True)
class Cluster:
    """Devices and links as the model sees them; bandwidths are effective bus bandwidths (GB/s)."""
    device: DeviceSpec
    num_devices: int
    devices_per_node: int
    intra_busbw_gbps: float
    inter_busbw_gbps: float
    peak_tflops: float
    memory_gb: float
    achievable_fraction: float = DEFAULT_ACHIEVABLE_FRACTION
    grad_reduce_bytes: int = 4  # fp32 main grads; 2 where grads are reduced in bf16/fp16
    grad_bucket_bytes: float = DEFAULT_GRAD_BUCKET_BYTES
    # fraction of the hideable communication each overlap hides (None: the backend's,
    # hardware.OVERLAP_EFFICIENCY); --calibrate fits it
    overlap: OverlapEfficiency | None = None
    # MoE layers: the engine's launch overhead per MoE layer and pass (--calibrate fits it from an
    # MoE run) and the expert load's max over mean (a run's moe_load_imbalance; 1: balanced)
    moe_pass_overhead_s: float = MOE_PASS_OVERHEAD_S
    moe_load_imbalance: float = 1.0
    # FP8 GEMMs (--fp8-format): the dense FP8 peak (None: the chip has none) and the fraction of
    # it the FP8 GEMMs reach (None: achievable_fraction; --calibrate on an FP8 run fits it)
    fp8_peak_tflops: float | None = None
    fp8_achievable_fraction: float | None = None
    # --optimizer-cpu-offload (offload.py): host link GB/s per direction, and the GB/s the host's
    # AdamW reaches (--calibrate fits it); None: unknown, the offload is not weighed
    host_link_gbps: float | None = None
    host_update_gbps: float | None = None
    # host memory per node (GiB) that an offloaded optimizer may take, shared by the node's devices
    # (--host-memory-gb); None: unbounded (a DGX node's 2 TB), the offload is not limited by it
    host_memory_gb: float | None = None

    @property
    def host_bytes_per_device(self) -> float | None:
        """Host bytes one device's process may hold, or None when unbounded."""
        if self.host_memory_gb is None:
            return None
        return self.host_memory_gb * GIB / min(self.devices_per_node, self.num_devices)

    @property
    def backend(self) -> str:
        """The collective backend the devices use: hccl (Ascend), nccl (NVIDIA), gloo (CPU)."""
        return backend_of(self.device.name)

    def __post_init__(self) -> None:
        if self.overlap is None:
            object.__setattr__(self, "overlap", OVERLAP_EFFICIENCY[self.backend])
        if self.num_devices < 1 or self.devices_per_node < 1:
            raise ValueError("--devices and --devices-per-node must be >= 1")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ValueError(f"--devices {self.num_devices} is not a whole number of nodes of "
                             f"--devices-per-node {self.devices_per_node}")
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(f"achievable fraction must be in (0, 1], got {self.achievable_fraction}")
        if min(self.intra_busbw_gbps, self.inter_busbw_gbps, self.peak_tflops, self.memory_gb) <= 0:
            raise ValueError("link bandwidths, peak and memory must be > 0")
        if self.fp8_peak_tflops is not None and not self.fp8_peak_tflops > 0:
            raise ValueError(f"the FP8 peak must be > 0 TFLOP/s, got {self.fp8_peak_tflops}")
        if self.fp8_achievable_fraction is not None and not 0 < self.fp8_achievable_fraction <= 1:
            raise ValueError(f"FP8 achievable fraction must be in (0, 1], got {self.fp8_achievable_fraction}")
        for key in ("host_link_gbps", "host_update_gbps", "host_memory_gb"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.moe_pass_overhead_s < 0 or not self.moe_load_imbalance >= 1:
            raise ValueError(f"the MoE pass overhead must be >= 0 and the load imbalance >= 1, got "
                             f"{self.moe_pass_overhead_s} and {self.moe_load_imbalance}")

    @classmethod
    def from_device(cls, spec: DeviceSpec, num_devices: int, devices_per_node: int | None = None,
                    intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
                    peak_tflops: float | None = None, memory_gb: float | None = None,
                    **kwargs) -> "Cluster":
        """Link rates (table defaults or overrides) times LINK_EFFICIENCY become bus bandwidths."""
        peak = peak_tflops if peak_tflops is not None else spec.peak_tflops
        mem = memory_gb if memory_gb is not None else spec.memory_gb
        if peak is None or mem is None:
            raise ValueError(f"device {spec.name} has no table peak or memory: "
                             f"give --peak-tflops and --memory-gb")
        intra = intra_node_gbps if intra_node_gbps is not None else spec.intra_node_gbps
        inter = inter_node_gbps if inter_node_gbps is not None else spec.inter_node_gbps
        kwargs.setdefault("fp8_peak_tflops", spec.fp8_tflops)
        kwargs.setdefault("host_link_gbps", spec.host_link_gbps)
        if spec.host_memory_gbps is not None:
            kwargs.setdefault("host_update_gbps", spec.host_memory_gbps * HOST_MEMORY_EFFICIENCY)
        return cls(spec, num_devices, devices_per_node or spec.devices_per_node,
                   intra * LINK_EFFICIENCY, inter * LINK_EFFICIENCY, peak, mem, **kwargs)

    @property
    def fp8_fraction(self) -> float:
        """The fraction of the FP8 peak the FP8 GEMMs reach (the bf16 one unless fitted)."""
        return self.achievable_fraction if self.fp8_achievable_fraction is None else self.fp8_achievable_fraction

    @property
    def usable_bytes(self) -> float:
        """What a layout may take per device: the memory less the allocator's and runtime's share."""
        return self.memory_gb * GIB * MEMORY_USABLE_FRACTION

    @property
    def multi_node(self) -> bool:
        return self.num_devices > self.devices_per_node


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vp: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"
    zero: bool = False
    sequence_parallel: bool = False
    cp: int = 1
    order: str = DEFAULT_ORDER  # the run's rank order, fastest-varying first (placement.py)
    # 1f1b (interleaved when vp > 1), or a zero-bubble schedule: zb-h1, or zb-v (vp = 2 chunks in
    # a V: device 0 holds the embedding and the output layer)
    schedule: str = "1f1b"
    zero_stage: int = 1  # with zero: 1 shards the optimizer state, 2 the gradients, 3 the weights
    # DP gradient compression: its exchange worker thread has a DP x CP communicator of its own
    compression: bool = False
    # Overlaps (Megatron-LM's flag names; engine/plan/overlap.py models them). tp_comm_overlap: the
    # sequence-parallel all-gathers and reduce-scatters of each layer as a ring of tp chunks beside
    # their GEMMs (no effect without sequence parallelism, as in Megatron-LM, which requires it).
    # overlap_grad_reduce: the DP reduction per bucket under the last micro-batch's backward (off:
    # all after backward). overlap_param_gather: ZeRO's all-gather per bucket ahead of the layer
    # that needs it in the next forward (off: waited for after the update). The engine's defaults.
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    # Expert parallelism (MoE layers): ep ranks drawn from the dp x cp ranks of a stage hold E/ep
    # experts each; expert gradients reduce over the expert-data-parallel group of dp x cp / ep
    # ranks (parallel/grid/expert_groups.py). Last, so that positional layouts keep their meaning.
    ep: int = 1
    # Expert tensor parallelism: 1 (every TP rank holds whole replicas of its E/ep experts) or tp
    # (the TP group splits every expert like the dense MLP; the EP and EDP groups are unchanged,
    # drawn from the dp x cp ranks of one TP coordinate; models/moe/experts.py).
    etp: int = 1
    # --optimizer-offload-fraction F of an offloaded run (0: none): F of the optimizer shard in host
    # memory, updated there (offload.py); needs zero (the distributed optimizer), at any dp
    offload: float = 0.0
    # with compression: whether every weight's bucket is compressed (a uniform --grad-compression),
    # so the compressors' residuals are counted (memory.py compression_bytes); a policy that leaves
    # some weights uncompressed is counted without them (a lower bound)
    compress_all: bool = True
    # --stage-end-weight W: the first and the last virtual stage count W layers more when layers
    # are split (parallel/pipeline/partition.py, the trainer's split): they get fewer
    stage_end_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule == "zb-v" and self.vp == 1:
            object.__setattr__(self, "vp", 2)   # zb-v always runs two chunks per rank
        for key in ("tp", "pp", "dp", "vp", "micro_batch_size", "cp", "ep", "etp"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"layout {key} must be a positive integer, got {getattr(self, key)!r}")
        if self.schedule not in PLAN_SCHEDULES + ("gpipe",):   # (GPipe: the memory check's)
            raise ValueError(f"schedule must be one of {PLAN_SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "gpipe" and self.vp != 1:
            raise ValueError(f"gpipe runs 1 chunk per rank, got vp={self.vp}")
        if not (isinstance(self.stage_end_weight, (int, float)) and self.stage_end_weight >= 0):
            raise ValueError(f"layout stage_end_weight must be a number >= 0, got "
                             f"{self.stage_end_weight!r}")
        if self.schedule == "zb-v" and self.vp != 2:
            raise ValueError(f"zb-v runs 2 chunks per rank, got vp={self.vp}")
        if self.schedule == "zb-h1" and self.vp != 1:
            raise ValueError(f"zb-h1 runs 1 chunk per rank, got vp={self.vp}")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"layout zero_stage must be 1, 2 or 3, got {self.zero_stage!r}")
        if not (isinstance(self.offload, (int, float)) and 0.0 <= self.offload <= 1.0):
            raise ValueError(f"layout offload must be a fraction in [0, 1], got {self.offload!r}")
        if self.offload and not self.zero:
            raise ValueError("optimizer offload moves the distributed optimizer's state: it needs "
                             "zero (--use-distributed-optimizer)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")
        parse_order(self.order, self.cp)

    @property
    def zero3(self) -> bool:
        """The parameters are sharded (ZeRO-3, optim_grads_params)."""
        return self.zero and self.zero_stage == 3

    @property
    def grads_sharded(self) -> bool:
        """The fp32 gradients live as 1/(dp x cp) shards (ZeRO-2 and ZeRO-3)."""
        return self.zero and self.zero_stage >= 2

    @property
    def edp(self) -> int:
        """Ranks of an expert-data-parallel group: the replicas of one EP rank's experts."""
        return self.dp * self.cp // self.ep if (self.dp * self.cp) % self.ep == 0 else 0

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    @property
    def pipeline_schedule(self) -> str:
        """The engine's --pipeline-schedule for this layout."""
        return "interleaved" if self.schedule == "1f1b" and self.vp > 1 else self.schedule

    @property
    def v_placement(self) -> bool:
        """zb-v with pp > 1: the first and the last virtual stage are both on device 0."""
        return self.schedule == "zb-v" and self.pp > 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp


def num_micro_batches(shape: ModelShape, layout: Layout) -> int:
    return shape.global_batch_size // (layout.micro_batch_size * layout.dp)


def check_layout(shape: ModelShape, cluster: Cluster, layout: Layout) -> str | None:
    """Why ``layout`` breaks a topology or divisibility rule, or None when it obeys them all.

    Links are not rules: a layout whose pipeline or DP groups cross nodes is priced, not rejected
    (timing.py reads each group's link from the rank order). Only TP must stay inside a node.
    Last, the caller's ``ModelShape.rules`` (the command line's: under ``--fp8-recipe blockwise``
    no TP or CP shard may cut a 128 scale tile, engine.train's own rule).
    """
    t, c, p, d, v, dpn = layout.tp, layout.cp, layout.pp, layout.dp, layout.vp, cluster.devices_per_node
    s = shape.seq_length
    if layout.world_size != cluster.num_devices:
        return f"tp*cp*pp*dp = {layout.world_size} != {cluster.num_devices} devices"
    if t > dpn or not all_groups_intra(layout.order, layout.sizes, "tp", dpn):
        return (f"TP must stay inside a node: tp {t} with order {layout.order} puts a TP group on "
                f"two nodes of {dpn} devices")
    if shape.num_attention_heads % t:
        return f"heads {shape.num_attention_heads} not divisible by tp {t}"
    if shape.ffn_hidden_size % t:
        return f"ffn hidden size {shape.ffn_hidden_size} not divisible by tp {t}"
    if shape.num_query_groups and shape.num_query_groups % t:
        return (f"query groups {shape.num_query_groups} not divisible by tp {t} (every TP rank "
                f"holds whole key/value groups)")
    if c > 1 and shape.attention_dropout:
        return ("context parallelism: ring attention applies no attention dropout; plan with "
                "--attention-dropout 0")
    if c > 1 and not shape.fused_attention:
        return "context parallelism runs ring attention on fused (flash) kernels: plan with --attention fused"
    if c > 1 and s % (2 * c):
        return (f"context parallelism: seq length {s} not divisible by 2*cp = {2 * c} "
                f"(load-balanced causal chunks)")
    if layout.sequence_parallel and (s // c) % t:
        return f"sequence parallelism: seq length {s}/cp {c} not divisible by tp {t}"
    if v > 1 and p == 1:
        return "virtual stages need pp > 1" if layout.schedule != "zb-v" else "zb-v needs pp > 1"
    if shape.num_layers % (p * v) and not layout.stage_end_weight:
        return f"layers {shape.num_layers} not divisible by pp*vp = {p * v}"
    if shape.num_layers < p * v:
        return f"layers {shape.num_layers} fewer than pp*vp = {p * v} stages"
    if shape.global_batch_size % (layout.micro_batch_size * d):
        return (f"global batch {shape.global_batch_size} not divisible by "
                f"micro-batch*dp = {layout.micro_batch_size * d}")
    if v > 1 and layout.schedule == "1f1b" and num_micro_batches(shape, layout) % p:
        return (f"interleaved schedule: micro-batches {num_micro_batches(shape, layout)} "
                f"not a multiple of pp {p}")
    why = check_moe_layout(shape, layout)
    for rule in shape.rules:
        why = why or rule(layout)
    return why

