"""The planner's named constants: sizes, bytes per element, efficiencies and per-operation costs.

Pure values, no code. engine/plan/model.py re-exports them (``from engine.plan.model import
GIB, ...`` keeps working); docs/planner.md explains each, with its source. The one fitted
constant is DEFAULT_ACHIEVABLE_FRACTION (see its comment).
"""
from __future__ import annotations

GIB = 2 ** 30
MAX_DEVICES = 2 ** 20  # 1,048,576 ranks: more than any cluster; a larger count is a typo
PLAN_PRECISION = "bf16"  # what the planner plans unless told (--precision); the dry run follows it
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
# tests/engine/plan/test_plan.py re-derives it from that row and holds the nine other rows to 15%.
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
# Korthikanti et al. 2022 activation bytes per layer, generalised to any f (see docs/planner.md):
# in bf16 with dropout 10 s b h replicated (LayerNorm inputs 2 x 2, QKV and MLP inputs, i.e. the
# column-parallel inputs, 2 x 2, dropout masks 2 x 1), 8 s b h split by TP (Q, K, V and the output
# projection's input), 4 or 6 s b f for the MLP, 5 a s^2 b for the scores. Under sequence
# parallelism every replicated one is a sequence shard: the column-parallel layers keep only their
# s/tp input shard and all-gather it again in backward.
ACT_MASK_BYTES = 1  # a dropout mask's byte per element
# Kept as tensor counts, for activations of any element size (ModelShape.activation_bytes)
# and with or without dropout masks (ModelShape.dropout); ACT_BYTES with dropout gives the above.
ACT_TENSORS_REPLICATED = 4  # two LayerNorm inputs, the QKV and MLP inputs (+ 2 dropout masks)
ACT_TENSORS_SPLIT_ATTN = 4  # Q, K, V, the output projection's input
ACT_TENSORS_MLP = {"gpt2": 2, "llama": 3}
# blocks with rotary position embeddings: their attention keeps RoPE's new q and k beside the whole
# QKV projection output (memory.layer_activation_bytes), h + kv_hidden per token more
ROPE_BLOCKS = ("llama",)
# MoE layers (memory.moe_activation_change): the experts' gathered input rows and their outputs
# (kept by the weighted combine), T K h each; the router's fp32 logits and scores, T E each; four
# int64 index vectors per assignment (the sort by expert, the rows' tokens, the dispatch's re-sort
# and its inverse). Time: the permutation's memory-bound passes, in units of T K h bytes (fp16):
# the rows' gather and the combine's gather (read + write each) and the combine's batched product
# (read) at any ep; under EP the dispatch's and the combine's re-sorts (read + write each).
ACT_MOE_ROWS = 2
ACT_MOE_FP32_PER_EXPERT = 2
ACT_MOE_INDEX_BYTES = 32
# the allgather dispatcher (moe_allgather.py) keeps beside them the int64 sort of every EP rank's
# T K gathered assignments (dropless), for its router weights' gather
ACT_MOE_GATHERED_INDEX_BYTES = 8
EW_MOE_PERMUTE = 10
EW_MOE_RESORT = 8
# What the engine adds to an MoE layer beyond its GEMMs, copies and all-to-alls (moe_time.py):
# the launches and tails of its routing, counting, permutation and combine kernels, about 30
# small kernels per forward or backward beyond a dense MLP's (LAYER_PASS_OVERHEAD_S's rate);
# the device idle per host wait (the queue drained while the host waited, the next kernels a
# launch latency away): under EP the split sizes' one read per layer and forward.
MOE_PASS_OVERHEAD_S = 0.15e-3
HOST_WAIT_S = 50e-6
VOCAB_PAD_MULTIPLE = 128  # the engine pads the vocabulary to a multiple of 128 x tp (equal shards)
# --optimizer-cpu-offload (engine/plan/offload.py). What torch's AdamW (its foreach path, what
# parallel/dp/offload.py runs on the host) reads and writes per fp32 element: p *= 1 - lr wd (8),
# m.lerp_(g) (12), v *= beta2 (8), v.addcmul_(g, g) (12), d = sqrt(v) (8), d /= sqrt(bc2) (8),
# d += eps (8), p.addcdiv_(m, d) (16): 80 bytes; bf16/fp16 parameters add the cast of the master
# into the staging copy that goes up (read 4, write 2). The copies: the fp32 gradient shard down
# (4 bytes), the parameters in their dtype up. The host's element-wise passes reach
# HOST_MEMORY_EFFICIENCY of its DRAM bandwidth (assumed equal to HBM_EFFICIENCY; --calibrate on an
# offloaded run fits the rate the update reaches, Cluster.host_update_gbps).
HOST_ADAM_BYTES_PER_PARAM = 80
HOST_CAST_BYTES_PER_PARAM = 6
HOST_GRAD_BYTES = 4
HOST_MEMORY_EFFICIENCY = 0.75
