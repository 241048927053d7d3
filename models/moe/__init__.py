"""Mixture-of-experts layers: the router (``router``), the load-balancing losses (``balancing``),
the experts (``experts``), expert capacity and token dropping (``capacity``), the layer that
replaces a block's MLP (``layer``, with ``build_mlp`` for blocks), the parsing of the MoE fields
of GPTConfig (``config``) and the step-level helpers a training loop uses (``stats``, and
``step_figures``: the step's MoE metrics and the expert-bias update). Token exchange between
expert-parallel ranks lives in parallel/expert_parallel/; docs/moe.md has the design.

Nothing is imported here: models/config.py imports ``models.moe.config`` and must not pull in the
layers (which import models.config).
"""
