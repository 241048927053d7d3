"""Memory and step-time model of one layout: the numbers the planner (engine/plan/search.py) ranks.

Pure arithmetic, no torch. Every constant is named here and explained in docs/planner.md; the one
fitted constant is DEFAULT_ACHIEVABLE_FRACTION (see its comment). Placement follows Megatron's
PTD-P rules: ranks are ordered tp (fastest), then pp, then dp (DP outermost); TP stays inside a
node; in a multi-node job pipeline neighbours sit on different nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.plan.flops import BLOCKS, RECOMPUTE, default_ffn_hidden
from engine.plan.hardware import DeviceSpec

GIB = 2 ** 30
# Mixed-precision Adam (Megatron): bf16 weight 2 + fp32 grad 4 + fp32 master 4 + m 4 + v 4.
BYTES_PER_PARAM = 18
ZERO1_REPLICATED_BYTES = 6  # ZeRO-1 keeps weight + grad on every rank, splits the 12 over dp
ZERO1_SHARDED_BYTES = 12
ACT_BYTES = 2  # bf16/fp16 activations and p2p/TP messages
MEMORY_USABLE_FRACTION = 0.90  # the rest: allocator fragmentation, comm buffers, runtime context
# Fraction of the dense peak the matrix multiplies reach, lumping kernel efficiency and whatever the
# model does not itemise. Fitted once (least squares in log space) to the three rows of Narayanan
# et al. 2021 Table 1 checked in tests/test_plan.py; the same value serves every row and device.
DEFAULT_ACHIEVABLE_FRACTION = 0.70
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
ACT_REPLICATED = 10  # s b h units not split by TP (LayerNorm inputs, dropout masks, QKV/MLP inputs)
ACT_SPLIT_ATTN = 8  # Q, K, V and the output projection's input, split by TP
ACT_MLP = {"gpt2": 4, "llama": 6}  # per s b f: GeLU input + output, or gate, up and product
ACT_SCORES = 5  # per a*s*s*b: softmax output (2), dropout mask (1), dropout output (2)


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
    # Flash-style attention (gridtron's kernels) keeps no s x s scores: no 5as/h activation term and
    # no score traffic. False models Megatron 2021's materialised softmax, as Korthikanti et al. do.
    fused_attention: bool = False

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
    relaxed_placement: bool = False

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

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "vp", "micro_batch_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"layout {key} must be a positive integer, got {getattr(self, key)!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")


def num_micro_batches(shape: ModelShape, layout: Layout) -> int:
    return shape.global_batch_size // (layout.micro_batch_size * layout.dp)


def check_layout(shape: ModelShape, cluster: Cluster, layout: Layout) -> str | None:
    """Why ``layout`` breaks a topology or divisibility rule, or None when it obeys them all."""
    t, p, d, v, dpn = layout.tp, layout.pp, layout.dp, layout.vp, cluster.devices_per_node
    if t * p * d != cluster.num_devices:
        return f"tp*pp*dp = {t * p * d} != {cluster.num_devices} devices"
    if t > dpn or dpn % t:
        return f"TP must stay inside a node: tp {t} must divide devices per node {dpn}"
    if shape.num_attention_heads % t:
        return f"heads {shape.num_attention_heads} not divisible by tp {t}"
    if layout.sequence_parallel and shape.seq_length % t:
        return f"sequence parallelism: seq length {shape.seq_length} not divisible by tp {t}"
    if v > 1 and p == 1:
        return "virtual stages need pp > 1"
    if shape.num_layers % (p * v):
        return f"layers {shape.num_layers} not divisible by pp*vp = {p * v}"
    if shape.global_batch_size % (layout.micro_batch_size * d):
        return (f"global batch {shape.global_batch_size} not divisible by "
                f"micro-batch*dp = {layout.micro_batch_size * d}")
    if v > 1 and num_micro_batches(shape, layout) % p:
        return (f"interleaved schedule: micro-batches {num_micro_batches(shape, layout)} "
                f"not a multiple of pp {p}")
    replica = t * p
    if cluster.multi_node and p > 1 and not cluster.relaxed_placement and t != dpn:
        return (f"PP across nodes: with DP outermost, pipeline neighbours share a node unless tp == "
                f"devices per node ({dpn}); got tp {t}")
    if cluster.multi_node and (replica > dpn and replica % dpn or replica < dpn and dpn % replica):
        return f"a model replica of tp*pp = {replica} devices does not tile nodes of {dpn}"
    return None


# ---- memory ------------------------------------------------------------------------------------

def layer_params_per_device(shape: ModelShape, tp: int) -> float:
    """One layer's weights on one TP rank: split matrices and column biases, replicated norms."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if shape.block == "llama":
        return (4 * h * h + 3 * h * f) / tp + 2 * h
    return (4 * h * h + 2 * h * f + 3 * h + f) / tp + 2 * h + 4 * h


def stage_params(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """Weights on the first and on the last pipeline device (embeddings, output layer, norms)."""
    h, V, t = shape.hidden_size, shape.vocab_size, layout.tp
    layers = shape.num_layers // layout.pp * layer_params_per_device(shape, t)
    embedding = V * h / t + (shape.seq_length * h if shape.block == "gpt2" else 0)
    tied = shape.block == "gpt2"
    output = (0 if tied and layout.pp == 1 else V * h / t) + (2 * h if shape.block == "gpt2" else h)
    if layout.pp == 1:
        return layers + embedding + output, layers + embedding + output
    return layers + embedding, layers + output


def layer_activation_bytes(shape: ModelShape, layout: Layout, recompute: str | None = None) -> float:
    """Korthikanti et al. 2022 bytes kept per layer per micro-batch, for any f and block."""
    s, b, h = shape.seq_length, layout.micro_batch_size, shape.hidden_size
    t, sp = layout.tp, layout.sequence_parallel
    recompute = recompute or layout.recompute
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    split = ACT_SPLIT_ATTN * sbh + ACT_MLP[shape.block] * s * b * shape.ffn_hidden_size
    base = (ACT_REPLICATED * sbh + split) / t if sp else ACT_REPLICATED * sbh + split / t
    if recompute == "selective":
        return base
    return base + scores_activation_bytes(shape, layout)


def scores_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """The attention scores' share (5 a s^2 b / t bytes), zero with fused attention."""
    if shape.fused_attention:
        return 0.0
    s = shape.seq_length
    return ACT_SCORES * shape.num_attention_heads * s * s * layout.micro_batch_size / layout.tp


def in_flight(shape: ModelShape, layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline device holds at its peak (Megatron's warm-up)."""
    p, v, m = layout.pp, layout.vp, num_micro_batches(shape, layout)
    if p == 1:
        return 1.0
    if v == 1:
        return float(min(p - stage, m))
    return min(((p - stage - 1) * 2 + (v - 1) * p + 1) / v, float(m))


@dataclass(frozen=True)
class Memory:
    weights: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.activations


def memory_per_device(shape: ModelShape, layout: Layout) -> Memory:
    """Bytes on the most loaded pipeline device (the first or the last)."""
    s, b, h, t = shape.seq_length, layout.micro_batch_size, shape.hidden_size, layout.tp
    per_param = (ZERO1_REPLICATED_BYTES + ZERO1_SHARDED_BYTES / layout.dp) if layout.zero else BYTES_PER_PARAM
    first_p, last_p = stage_params(shape, layout)
    layers = shape.num_layers // layout.pp
    act = layer_activation_bytes(shape, layout)
    transient = {"full": layer_activation_bytes(shape, layout, "none"),
                 "selective": scores_activation_bytes(shape, layout),
                 "none": 0.0}[layout.recompute]
    shard = t if layout.sequence_parallel else 1
    embedding = s * b * h / shard  # embedding dropout mask, per micro-batch in flight
    logits = 4 * s * b * h / shard + 4 * s * b * shape.vocab_size / t  # norm/output inputs, fp32 logits
    first = Memory(first_p * per_param, layers * act * in_flight(shape, layout, 0)
                   + embedding * in_flight(shape, layout, 0) + transient)
    last = Memory(last_p * per_param, layers * act * in_flight(shape, layout, layout.pp - 1)
                  + logits + transient)
    if layout.pp == 1:
        return Memory(first.weights, first.activations + logits)
    return max(first, last, key=lambda mem: mem.total)
