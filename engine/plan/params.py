"""Parameter counts per layer and device, and which layers a pipeline rank holds (pure arithmetic,
shared by the memory and ZeRO-3 models)."""
from __future__ import annotations

from engine.plan.model import Layout, ModelShape
from parallel.pipeline.partition import partition_layers


def layer_params_per_device(shape: ModelShape, tp: int) -> float:
    """One layer's weights on one TP rank: split matrices and column biases, replicated norms
    (with --qk-layernorm also the queries' and the keys' norm of head_dim each).
    Attention: Q and the output projection h x h each, K and V h x kv_hidden each."""
    h, f, kv = shape.hidden_size, shape.ffn_hidden_size, shape.kv_hidden
    attn = 2 * h * h + 2 * h * kv
    qk = 2 * (h // shape.num_attention_heads) if shape.qk_layernorm else 0
    if shape.block == "llama":
        return (attn + 3 * h * f) / tp + 2 * h + qk
    return (attn + 2 * h * f + h + 2 * kv + f) / tp + 2 * h + 4 * h + qk


def virtual_stages(layout: Layout, stage: int) -> tuple[int, ...]:
    """The virtual stages (model chunks) pipeline rank ``stage`` holds, in chunk order:
    ``chunk * pp + stage`` (zb-v: ``stage`` and ``2 pp - 1 - stage``)."""
    p = layout.pp
    return (stage, 2 * p - 1 - stage) if layout.v_placement else tuple(c * p + stage for c in range(layout.vp))


def chunk_ranges(shape: ModelShape, layout: Layout) -> list[range]:
    """The layers of each virtual stage (index ``chunk * pp + stage``; the V's own under zb-v), as
    the trainer splits them: num_layers / (pp vp) each, or with ``stage_end_weight`` W the
    partition that gives the two end stages W layers' worth less (parallel/pipeline/partition.py;
    10 layers on 4 stages with W 1: 2, 3, 3, 2). Ranges, not lists: the memory check at start
    meets --num-layers in the billions."""
    stages = layout.pp * layout.vp
    if not layout.stage_end_weight and shape.num_layers % stages == 0:
        n = shape.num_layers // stages
        return [range(v * n, (v + 1) * n) for v in range(stages)]
    return partition_layers(shape.num_layers, layout.pp, layout.vp, layout.stage_end_weight)


def stage_ranges(shape: ModelShape, layout: Layout, stage: int) -> list[range]:
    """The layer ranges of pipeline rank ``stage``'s chunks, chunk order (``virtual_stages``)."""
    ranges = chunk_ranges(shape, layout)
    return [ranges[vs] for vs in virtual_stages(layout, stage)]


def stage_layer_count(shape: ModelShape, layout: Layout, stage: int) -> int:
    """How many layers pipeline rank ``stage`` holds."""
    return sum(len(r) for r in stage_ranges(shape, layout, stage))


def stage_layers(shape: ModelShape, layout: Layout, stage: int) -> list[int]:
    """Global indices of the layers pipeline rank ``stage`` holds."""
    return [i for r in stage_ranges(shape, layout, stage) for i in r]


def stage_fp8_layers(shape: ModelShape, layout: Layout, stage: int) -> int:
    """FP8 layers among the layers of pipeline rank ``stage``, counted by ranges."""
    if shape.fp8_recipe is None:
        return 0
    first, last = shape.fp8_bf16_layers
    lo, hi = first, shape.num_layers - last
    return sum(max(0, min(hi, r.stop) - max(lo, r.start)) for r in stage_ranges(shape, layout, stage))


def stage_moe_layers(shape: ModelShape, layout: Layout, stage: int) -> int:
    """MoE layers among the layers of pipeline rank ``stage``."""
    if shape.moe is None:
        return 0
    return sum(1 for i in stage_layers(shape, layout, stage) if shape.is_moe(i))


def expert_params_per_layer(shape: ModelShape, ep: int, etp: int = 1) -> float:
    """One MoE layer's expert weights on one rank: E/ep experts, n_mat h f_e each (gpt2 also the
    biases f_e + h). With ETP = 1 every TP rank holds the same whole experts; with ETP = tp each
    holds 1/etp of every matrix and of the fc1 bias, and the whole fc2 bias (models/moe/experts.py:
    added by ETP rank 0 only): n_mat h f_e / etp, gpt2 also f_e / etp + h."""
    moe, h = shape.moe, shape.hidden_size
    f = moe.ffn_hidden
    one = 3 * h * f / etp if shape.block == "llama" else (2 * h * f + f) / etp + h
    return moe.num_experts // ep * one


def moe_dense_change_per_layer(shape: ModelShape, tp: int) -> float:
    """What an MoE layer's dense parameters (the replicated (E, h) router and the tensor-parallel
    shared expert) hold on one TP rank beyond, or short of, the dense MLP it replaces."""
    moe, h, f = shape.moe, shape.hidden_size, shape.ffn_hidden_size
    if shape.block == "llama":
        mlp = lambda width: 3 * h * width / tp if width else 0.0  # noqa: E731
    else:  # column-parallel fc1 and its bias split, fc2's bias replicated
        mlp = lambda width: (2 * h * width + width) / tp + h if width else 0.0  # noqa: E731
    return moe.num_experts * h + mlp(moe.shared_ffn) - mlp(f)
