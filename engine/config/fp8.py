"""FP8 flags against the rest of the run (pure; called by schema.py's ``RunConfig``):
``--fp8-format`` with ``--compile`` or with bf16 layers that leave none, and ``--fp8-recipe
blockwise``'s format and tile rule (docs/precision.md)."""
from __future__ import annotations

from engine.config.parallel import ParallelConfig
from kernels.fp8 import Fp8Recipe
from kernels.fp8_tiles import layout_problem
from models.config import GPTConfig


def check_fp8_flags(cfg, model_known: bool | None = None) -> None:
    """What FP8 cannot run with in the run configuration ``cfg`` (docs/precision.md): --compile,
    the recipe's own rules (``kernels.fp8.Fp8Recipe``: blockwise takes e4m3 only), and, once the
    model's shape is known, bf16 layers that leave none and blockwise's tile rule.
    ``model_known``: None reads it from ``cfg`` (under --use-checkpoint-args with --load the shape
    comes from the checkpoint later: engine/checkpoint/reader.py ``with_checkpoint_args`` checks
    again with True)."""
    p = cfg.precision
    if p.fp8_format is None:
        return
    if cfg.compile:
        raise ValueError(f"--fp8-format {p.fp8_format} with --compile is not built: the FP8 "
                         f"layers agree their scales with collectives inside their autograd "
                         f"Functions, which run eagerly; drop --compile or --fp8-format")
    Fp8Recipe(p.fp8_format, p.fp8_recipe)   # a ValueError: the recipe's own line
    if model_known is None:
        model_known = not (cfg.checkpoint.use_checkpoint_args and cfg.checkpoint.load)
    if not model_known:
        return
    if p.fp8_recipe == "blockwise":
        problem = blockwise_problem(cfg.model, cfg.parallel)
        if problem:
            raise ValueError(problem)
    start, end = p.fp8_bf16_layers
    if start + end >= cfg.model.num_layers:
        raise ValueError(f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 "
                         f"{end} keep all {cfg.model.num_layers} layers in bf16, so --fp8-format "
                         f"changes nothing; lower them or drop --fp8-format")


def blockwise_problem(model: GPTConfig, parallel: ParallelConfig) -> str | None:
    """Why ``--fp8-recipe blockwise`` would not quantize with the serial run's scales in this
    layout, or None (``kernels.fp8_tiles.layout_problem``): TP splits the QKV projection's
    width, the attention output's input (the hidden size), the MLP's width and the shared
    expert's; CP the sequence (2 cp load-balanced chunks for the ring, cp contiguous shards for
    a2a). A user block's own layers are the user's to size alike (docs/precision.md).

    >>> from models.config import GPTConfig
    >>> from engine.config.parallel import ParallelConfig
    >>> blockwise_problem(GPTConfig(hidden_size=256, num_attention_heads=4, seq_length=256),
    ...                   ParallelConfig(tp=2))
    >>> print(blockwise_problem(GPTConfig(hidden_size=128, num_attention_heads=4),
    ...                         ParallelConfig(tp=2)).split(";")[0])
    --fp8-recipe blockwise at --tp 2 needs each rank's share of the QKV projection's width ((heads + 2 groups) x head dim) (384 / 2) to be a multiple of 128, so that every scale tile is whole on one rank
    """
    widths = [("the QKV projection's width ((heads + 2 groups) x head dim)",
               (model.num_attention_heads + 2 * model.num_query_groups) * model.head_dim),
              ("--hidden-size (the attention output's input)", model.hidden_size),
              ("--ffn-hidden-size", model.ffn_hidden_size)]
    if model.moe_shared_expert_intermediate_size:
        widths.append(("--moe-shared-expert-intermediate-size",
                       model.moe_shared_expert_intermediate_size))
    cp = parallel.cp
    return layout_problem(widths, parallel.tp, model.seq_length, cp,
                          2 * cp if parallel.cp_comm_type == "p2p" else cp)
