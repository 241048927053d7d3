"""The expert rules of a layout and the tokens an MoE layer's rank routes (model.py re-exports
them): pure arithmetic, no torch; ``shape`` is a model.ModelShape, ``layout`` a model.Layout
(not imported: model.py imports this module)."""
from __future__ import annotations

from engine.plan.flops import expert_capacity


def moe_tokens(shape, layout) -> float:
    """Tokens one rank routes through an MoE layer per micro-batch: its s b / cp, and under
    sequence parallelism its 1/tp shard of them (each TP rank routes its own,
    models/moe/layer.py); without it every TP rank routes the same tokens."""
    tokens = shape.seq_length * layout.micro_batch_size / layout.cp
    return tokens / layout.tp if layout.sequence_parallel else tokens


def moe_expert_tokens(shape, layout) -> float:
    """Tokens whose rows one rank permutes, dispatches and computes its experts on per MoE layer
    and micro-batch: the tokens it routes (``moe_tokens``), except under expert tensor parallelism
    with sequence parallelism, where the TP ranks gather their shards and every expert slice
    computes the TP group's s b / cp tokens."""
    if layout.etp > 1 and layout.sequence_parallel:
        return shape.seq_length * layout.micro_batch_size / layout.cp
    return moe_tokens(shape, layout)


def moe_expert_rows(shape, layout) -> float:
    """Rows one rank's experts compute (and the alltoall dispatcher sends) per MoE layer and
    micro-batch: T K of ``moe_expert_tokens``' T, or padded to capacity every expert's C =
    ceil(F T K / E) rows, E C in all (models/moe/capacity.py ``expert_capacity``; no counts are
    exchanged then)."""
    moe = shape.moe
    tokens = moe_expert_tokens(shape, layout)
    if moe.padded_capacity_factor is None:
        return tokens * moe.topk
    return moe.num_experts * expert_capacity(moe, int(tokens))


def check_moe_layout(shape, layout) -> str | None:
    """The expert rules (engine/config/schema.py ``check_expert_flags``,
    parallel/grid/expert_groups.py): ep divides dp x cp and the experts, etp is 1 or tp and divides
    the expert width, so that every command the planner prints runs."""
    ep, etp, moe = layout.ep, layout.etp, shape.moe
    if moe is None:
        if etp > 1:
            return f"etp {etp} needs MoE layers (--num-experts)"
        return None if ep == 1 else f"ep {ep} needs MoE layers (--num-experts)"
    if (layout.dp * layout.cp) % ep:
        return f"ep {ep} does not divide dp x cp = {layout.dp * layout.cp}"
    if moe.num_experts % ep:
        return f"experts {moe.num_experts} not divisible by ep {ep}"
    if etp not in (1, layout.tp):
        return f"etp {etp}: only 1 or tp {layout.tp} is built"
    if moe.ffn_hidden % etp:
        return f"expert width {moe.ffn_hidden} not divisible by etp {etp}"
    return None
