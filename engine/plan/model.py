"""Shapes, layouts, topology rules and the memory model: what the planner (search.py) ranks.

Pure arithmetic, no torch. Every constant is named here and explained in docs/planner.md; the one
fitted constant is DEFAULT_ACHIEVABLE_FRACTION (see its comment). Placement follows the run's rank
order (``Layout.order``, DESIGN.md's ``tp-cp-dp-pp`` by default; see placement.py): TP must stay
inside a node, every other group is priced on the links its ranks span (timing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.plan.flops import BLOCKS, RECOMPUTE, default_ffn_hidden
from engine.plan.hardware import DeviceSpec
from engine.plan.placement import DEFAULT_ORDER, all_groups_intra, parse_order

GIB = 2 ** 30
PLAN_SCHEDULES = ("1f1b", "zb-h1", "zb-v")  # interleaved: "1f1b" with vp > 1
# Mixed-precision Adam (Megatron): bf16 weight 2 + fp32 main grad 4 + fp32 master, m, v 12.
WEIGHT_BYTES = 2
GRAD_BYTES = 4
OPTIMIZER_STATE_BYTES = 12
BYTES_PER_PARAM = WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_STATE_BYTES  # 18
ZERO1_REPLICATED_BYTES = WEIGHT_BYTES + GRAD_BYTES  # ZeRO-1 keeps weight + grad on every rank
ZERO1_SHARDED_BYTES = OPTIMIZER_STATE_BYTES  # and splits the 12 over the dp x cp ranks
ACT_BYTES = 2  # bf16/fp16 activations and p2p/TP messages
MEMORY_USABLE_FRACTION = 0.90  # the rest: allocator fragmentation, runtime context
# Communicator buffers, outside the framework's allocator (so outside peak_memory_bytes too).
# HCCL: every communicator reserves 2 x HCCL_BUFFSIZE (send and receive), default 200 MB (CANN
# environment variable reference, "HCCL_BUFFSIZE"); torch_npu's point-to-point transfers use one
# communicator per neighbour pair with 2 x P2P_HCCL_BUFFSIZE, default 20 MB (Ascend Extension for
# PyTorch 7.1.0, "P2P_HCCL_BUFFSIZE"). NCCL publishes no per-communicator total: its buffers grow
# with the channel count (a ring has 2 connections per channel, each a FIFO of NCCL_BUFFSIZE = 4 MiB
# for the Simple protocol); NCCL_CHANNELS_ASSUMED = 16 makes it 128 MiB, an estimate.
HCCL_BUFFSIZE_MB = 200
P2P_HCCL_BUFFSIZE_MB = 20
NCCL_BUFFSIZE_BYTES = 4 * 2 ** 20
NCCL_CHANNELS_ASSUMED = 16
COMM_BUFFER_BYTES = {"hccl": 2 * HCCL_BUFFSIZE_MB * 2 ** 20,
                     "nccl": 2 * NCCL_CHANNELS_ASSUMED * NCCL_BUFFSIZE_BYTES, "gloo": 0}
P2P_BUFFER_BYTES = {"hccl": 2 * P2P_HCCL_BUFFSIZE_MB * 2 ** 20, "nccl": 0, "gloo": 0}
# Fraction of the dense peak the matrix multiplies reach, lumping kernel efficiency and whatever the
# model does not itemise. Fitted (bisection, search.fit_achievable_fraction) on ONE published row,
# FIT_ROW of Narayanan et al. 2021 Table 1 (1.7B: tp 1, pp 1, dp 32, no model-parallel traffic);
# tests/test_plan.py re-derives it from that row and holds the nine other rows to 15%.
DEFAULT_ACHIEVABLE_FRACTION = 0.668
FIT_ROW = "1.7B"
HBM_EFFICIENCY = 0.75  # fraction of HBM bandwidth reached by fused element-wise kernels
LINK_EFFICIENCY = 0.80  # bus bandwidth collectives reach over a link's rate (nccl-tests on DGX A100)
COLLECTIVE_LATENCY_S = 20e-6  # fixed cost per collective or p2p message
LAYER_PASS_OVERHEAD_S = 0.1e-3  # launches and tails of ~20 kernels per layer forward or backward
OPTIMIZER_BYTES_PER_PARAM = 30  # Adam: read grad/master/m/v (16), write master/m/v (12) + bf16 copy (2)
DEFAULT_GRAD_BUCKET_BYTES = 25 * 2 ** 20  # the engine's default DP bucket (--bucket-size-mb 25)
# Memory-bound traffic per layer forward, in units of s*b*h bytes (fp16), Megatron 2021 kernels:
EW_REPLICATED = 22  # two LayerNorms (4 each) + two fused bias-dropout-adds (7 each): whole h
EW_SHARDED_ATTN = 12  # Q, K, V layout changes (read + write 3 s b h/t)
EW_MLP = {"gpt2": 4, "llama": 6}  # fused bias-GeLU (read + write s b f) or SwiGLU (read 2, write 1)
EW_SCORES = 9  # per a*s*s*b: fused scale-mask-softmax (read + write) and dropout (read, write, mask)
# Korthikanti et al. 2022 activation bytes per layer, generalised to any f (see docs/planner.md).
# ACT_REPLICATED: LayerNorm inputs (2 x 2), QKV and MLP inputs, i.e. the column-parallel inputs
# (2 x 2), dropout masks (2 x 1). Under sequence parallelism every one of them is a sequence shard:
# the column-parallel layers keep only their s/tp input shard and all-gather it again in backward.
ACT_REPLICATED = 10
ACT_SPLIT_ATTN = 8  # Q, K, V and the output projection's input, split by TP
ACT_MLP = {"gpt2": 4, "llama": 6}  # per s b f: GeLU input + output, or gate, up and product
ACT_SCORES = 5  # per a*s*s*b: softmax output (2), dropout mask (1), dropout output (2)
ACT_MASK_BYTES = 1  # a dropout mask's byte per element
# The same accounting by tensor count, for activations of any element size (ModelShape.activation_bytes)
# and with or without dropout masks (ModelShape.dropout); ACT_BYTES with dropout gives the above.
ACT_TENSORS_REPLICATED = 4  # two LayerNorm inputs, the QKV and MLP inputs (+ 2 dropout masks)
ACT_TENSORS_SPLIT_ATTN = 4  # Q, K, V, the output projection's input
ACT_TENSORS_MLP = {"gpt2": 2, "llama": 3}
VOCAB_PAD_MULTIPLE = 128  # the engine pads the vocabulary to a multiple of 128 x tp (equal shards)


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
    # Key/value head groups of grouped-query attention (None: one per head, plain multi-head).
    num_query_groups: int | None = None
    # Bytes per weight: 2 (bf16/fp16, with fp32 masters in the optimizer) or 4 (an fp32 run, whose
    # weights are their own masters).
    weight_bytes: int = WEIGHT_BYTES

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
        if self.activation_bytes not in (1, 2, 4):
            raise ValueError(f"activation_bytes must be 1, 2 or 4, got {self.activation_bytes!r}")
        if self.weight_bytes not in (2, 4):
            raise ValueError(f"weight_bytes must be 2 or 4, got {self.weight_bytes!r}")
        g = self.num_query_groups
        if g is not None and (not isinstance(g, int) or g < 1 or self.num_attention_heads % g):
            raise ValueError(f"--num-query-groups {g!r} must be a positive divisor of "
                             f"--num-attention-heads {self.num_attention_heads}")

    @property
    def kv_hidden(self) -> int:
        """Width of the key (and of the value) projection: query groups x head size."""
        groups = self.num_query_groups or self.num_attention_heads
        return groups * (self.hidden_size // self.num_attention_heads)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary as the engine allocates it: a multiple of 128 x tp (its padding rows are
        zero; parallel.tensor_parallel.padded_vocab_size)."""
        step = VOCAB_PAD_MULTIPLE * tp
        return -(-self.vocab_size // step) * step


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

    @property
    def backend(self) -> str:
        """The collective backend the devices use: hccl (Ascend), nccl (NVIDIA), gloo (CPU)."""
        name = self.device.name
        return "hccl" if name.startswith("ascend") else "gloo" if name == "cpu" else "nccl"

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.devices_per_node < 1:
            raise ValueError("--devices and --devices-per-node must be >= 1")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ValueError(f"--devices {self.num_devices} is not a whole number of nodes of "
                             f"--devices-per-node {self.devices_per_node}")
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(f"achievable fraction must be in (0, 1], got {self.achievable_fraction}")
        if min(self.intra_busbw_gbps, self.inter_busbw_gbps, self.peak_tflops, self.memory_gb) <= 0:
            raise ValueError("link bandwidths, peak and memory must be > 0")

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
        return cls(spec, num_devices, devices_per_node or spec.devices_per_node,
                   intra * LINK_EFFICIENCY, inter * LINK_EFFICIENCY, peak, mem, **kwargs)

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
    zero_stage: int = 1  # with zero: 1 shards the optimizer state, 2 also the fp32 gradients

    def __post_init__(self) -> None:
        if self.schedule == "zb-v" and self.vp == 1:
            object.__setattr__(self, "vp", 2)   # zb-v always runs two chunks per rank
        for key in ("tp", "pp", "dp", "vp", "micro_batch_size", "cp"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"layout {key} must be a positive integer, got {getattr(self, key)!r}")
        if self.schedule not in PLAN_SCHEDULES:
            raise ValueError(f"schedule must be one of {PLAN_SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "zb-v" and self.vp != 2:
            raise ValueError(f"zb-v runs 2 chunks per rank, got vp={self.vp}")
        if self.schedule == "zb-h1" and self.vp != 1:
            raise ValueError(f"zb-h1 runs 1 chunk per rank, got vp={self.vp}")
        if self.zero_stage not in (1, 2):
            raise ValueError(f"layout zero_stage must be 1 or 2, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")
        parse_order(self.order, self.cp)

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
    if c > 1 and not shape.fused_attention:
        return "context parallelism runs ring attention on fused (flash) kernels: plan with --attention fused"
    if c > 1 and s % (2 * c):
        return (f"context parallelism: seq length {s} not divisible by 2*cp = {2 * c} "
                f"(load-balanced causal chunks)")
    if layout.sequence_parallel and (s // c) % t:
        return f"sequence parallelism: seq length {s}/cp {c} not divisible by tp {t}"
    if v > 1 and p == 1:
        return "virtual stages need pp > 1" if layout.schedule != "zb-v" else "zb-v needs pp > 1"
    if shape.num_layers % (p * v):
        return f"layers {shape.num_layers} not divisible by pp*vp = {p * v}"
    if shape.global_batch_size % (layout.micro_batch_size * d):
        return (f"global batch {shape.global_batch_size} not divisible by "
                f"micro-batch*dp = {layout.micro_batch_size * d}")
    if v > 1 and layout.schedule == "1f1b" and num_micro_batches(shape, layout) % p:
        return (f"interleaved schedule: micro-batches {num_micro_batches(shape, layout)} "
                f"not a multiple of pp {p}")
    return None


# ---- memory ------------------------------------------------------------------------------------

def layer_params_per_device(shape: ModelShape, tp: int) -> float:
    """One layer's weights on one TP rank: split matrices and column biases, replicated norms.
    Attention: Q and the output projection h x h each, K and V h x kv_hidden each."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_hidden
    attn = 2 * h * h + 2 * h * kv
    if shape.block == "llama":
        return (attn + 3 * h * f) / tp + 2 * h
    return (attn + 2 * h * f + h + 2 * kv + f) / tp + 2 * h + 4 * h


def stage_param_count(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Weights on a device of pipeline rank ``stage``: its layers (num_layers / pp), on the first
    the word (V_pad h / t) and, for gpt2, position embeddings, on the last the output layer (for
    gpt2 with pp > 1 its own copy of the tied embedding) and the final norm; under zb-v the first
    holds the output layer and final norm too (the tied embedding is then one parameter)."""
    h, t, p = shape.hidden_size, layout.tp, layout.pp
    vocab = shape.padded_vocab(t) * h / t
    params = shape.num_layers // p * layer_params_per_device(shape, t)
    tied = shape.block == "gpt2"
    # under zb-v device 0 holds both ends of the V, and the tied output layer is its embedding
    holds_output = stage == 0 if layout.v_placement and p > 1 else stage == p - 1
    if stage == 0:
        params += vocab + (shape.seq_length * h if tied else 0)
    if holds_output:
        params += (0 if tied and (p == 1 or layout.v_placement) else vocab) + (2 * h if tied else h)
    return params


def stage_params(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """Weights on the first and on the last pipeline device (embeddings, output layer, norms)."""
    return stage_param_count(shape, layout, 0), stage_param_count(shape, layout, layout.pp - 1)


def layer_activation_bytes(shape: ModelShape, layout: Layout, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022 bytes kept per layer per micro-batch, for any f and block.

    Context parallelism splits the sequence: every term is divided by cp.
    """
    s, b, h = shape.seq_length, layout.micro_batch_size, shape.hidden_size
    t, sp, c = layout.tp, layout.sequence_parallel, layout.cp
    recompute = recompute or layout.recompute
    sbh = s * b * h / c
    e, masks = shape.activation_bytes, ACT_MASK_BYTES if shape.dropout else 0
    if recompute == "full":
        return e * sbh / (t if sp else 1)
    replicated = ACT_TENSORS_REPLICATED * e + 2 * masks          # 10 in bf16 with dropout
    attn = ACT_TENSORS_SPLIT_ATTN - 2 + 2 * shape.kv_hidden / h  # Q, K, V, projection input
    split = (attn * e * sbh                                      # 8 without GQA
             + ACT_TENSORS_MLP[shape.block] * e * s * b * shape.ffn_hidden_size / c)  # 4 or 6 per sbf
    base = (replicated * sbh + split) / t if sp else replicated * sbh + split / t
    if recompute == "selective":
        return base
    return base + scores_activation_bytes(shape, layout)


def scores_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """The attention scores' share (5 a s^2 b / t bytes), zero with fused attention."""
    if shape.fused_attention:
        return 0.0
    s, e = shape.seq_length, shape.activation_bytes
    per = e + (ACT_MASK_BYTES + e if shape.dropout else 0)  # 5 in bf16 with dropout
    return per * shape.num_attention_heads * s * s * layout.micro_batch_size / layout.tp


def in_flight(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline device holds at its peak (Megatron's warm-up;
    zero-bubble schedules count a micro-batch until its W, the weight gradients needing the
    layers' inputs: zb-h1 min(p, m) on every device, zb-v the schedule's own peak of half-stage
    chunks, p stages' worth once m >= 2p - 1)."""
    p, v, m = layout.pp, layout.vp, num_micro_batches(shape, layout)
    if p == 1:
        return 1.0
    if layout.schedule == "zb-h1":
        return float(min(p, m))
    if layout.schedule == "zb-v":
        from parallel.pipeline.schedules import build_schedule, in_flight_peaks
        return in_flight_peaks(build_schedule("zb-v", p, min(m, 2 * p)))[stage] / 2
    if v == 1:
        return float(min(p - stage, m))
    return min(((p - stage - 1) * 2 + (v - 1) * p + 1) / v, float(m))


def communicators(layout: Layout, tied_embeddings: bool, stage: str = "first") -> tuple[int, int]:
    """(collective communicators, point-to-point neighbour pairs) of a device of the "first",
    "middle" or "last" stage: one per process group of more than one rank that issues a
    collective (world, tp, cp, dp or, when cp > 1, dp x cp, pp, mp = tp x pp, and the
    tied-embedding pair of the first and last stages), and, with pp > 1, its pipeline neighbours
    (one at either end; two for a middle stage, and at the ends when the interleaved schedule wraps
    the last stage around to the first and pp > 2).

    >>> communicators(Layout(tp=2, pp=2, dp=2), tied_embeddings=True)  # world tp dp pp mp embedding
    (6, 1)
    """
    t, c, p, d = layout.tp, layout.cp, layout.pp, layout.dp
    # with cp > 1 gradients are reduced over dp x cp: the DP group alone carries no collective;
    # under zb-v the tied pair is one device: its group is never used, so never created
    paired = p > 1 and tied_embeddings and stage != "middle" and not layout.v_placement
    groups = [layout.world_size, t, c, d if c == 1 else 1, d * c if c > 1 else 1, p, t * p,
              2 if paired else 1]
    neighbours = 0 if p == 1 else (2 if (layout.vp > 1 or stage == "middle") and p > 2 else 1)
    return sum(1 for size in groups if size > 1), neighbours


def comm_buffer_bytes(layout: Layout, backend: str, tied_embeddings: bool, stage: str = "first") -> float:
    """Bytes the communication library reserves on one device for its communicators."""
    collective, p2p = communicators(layout, tied_embeddings, stage)
    return collective * COMM_BUFFER_BYTES[backend] + p2p * P2P_BUFFER_BYTES[backend]


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on one device, by part. A new part is a new field (and its line in memory_per_device)."""
    weights: float  # bf16 parameters
    grads: float  # fp32 main gradients
    optimizer: float  # fp32 master weights, Adam m and v (ZeRO-1: a 1/(dp*cp) shard)
    activations: float  # the layers' saved activations x micro-batches in flight
    transient: float  # one layer rebuilt by recomputation during backward
    pipeline_ends: float  # embedding dropout mask (first stage), final norm + fp32 logits (last)
    comm_buffers: float = 0.0  # HCCL / NCCL communicator buffers (comm_buffer_bytes)
    stage: str = "only"  # which device this is: "only" (pp = 1), "first" or "last"

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "stage")

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def optimizer_bytes_per_param(shape: ModelShape, layout: Layout) -> float:
    """fp32 master, Adam m and v per weight (an fp32 weight is its own master), split over the
    dp x cp ranks under ZeRO (whose shards always keep an fp32 master)."""
    if layout.zero:
        return OPTIMIZER_STATE_BYTES / (layout.dp * layout.cp)
    return OPTIMIZER_STATE_BYTES - (4 if shape.weight_bytes == 4 else 0)


def stage_name(layout: Layout, stage: int) -> str:
    if layout.pp == 1:
        return "only"
    return "first" if stage == 0 else "last" if stage == layout.pp - 1 else "middle"


def stage_memory(shape: ModelShape, layout: Layout, stage: int, backend: str = "gloo") -> MemoryTerms:
    """Bytes on a device of pipeline rank ``stage``; ``backend`` (hccl, nccl, gloo) prices the
    communicator buffers."""
    s, b, h, t, c = shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp, layout.cp
    shards = layout.dp * c if layout.zero else 1
    params = stage_param_count(shape, layout, stage)
    layers = shape.num_layers // layout.pp
    transient = {"full": layer_activation_bytes(shape, layout, "none"),
                 "selective": scores_activation_bytes(shape, layout),
                 "none": 0.0}[layout.recompute]
    shard = t if layout.sequence_parallel else 1
    # the embedding's dropout mask, per micro-batch in flight (none without dropout)
    embedding = s * b * h / c / shard * (ACT_MASK_BYTES if shape.dropout else 0)
    # the final norm's and the output layer's inputs, and the fp32 logits
    logits = (2 * shape.activation_bytes * s * b * h / shard + 4 * s * b * shape.padded_vocab(t) / t) / c
    name = stage_name(layout, stage)
    ends = {"only": embedding + logits, "first": embedding * in_flight(shape, layout, 0),
            "last": logits, "middle": 0.0}[name]
    if layout.v_placement and layout.pp > 1:  # device 0: the embedding and the output layer
        ends = {"first": embedding * in_flight(shape, layout, 0) + logits}.get(name, 0.0)
    grads = GRAD_BYTES / (shards if layout.zero and layout.zero_stage == 2 else 1)
    return MemoryTerms(params * shape.weight_bytes, params * grads,
                       params * optimizer_bytes_per_param(shape, layout),
                       layers * layer_activation_bytes(shape, layout) * in_flight(shape, layout, stage),
                       transient, ends, comm_buffer_bytes(layout, backend, shape.block == "gpt2", name),
                       name)


def memory_per_device(shape: ModelShape, layout: Layout, backend: str = "gloo") -> MemoryTerms:
    """Bytes on the most loaded pipeline device (the first or the last); ``backend`` (hccl, nccl,
    gloo) prices the communicator buffers."""
    first = stage_memory(shape, layout, 0, backend)
    if layout.pp == 1:
        return first
    return max(first, stage_memory(shape, layout, layout.pp - 1, backend), key=lambda mem: mem.total)
