"""Logical tensors held inside one parameter: the stacked expert weights of a mixture-of-experts
layer (models/moe/experts.py) are one Parameter per projection, (E_local, out, in), holding one
logical tensor per expert (and, for SwiGLU's fused gate-up projection, two: ``gate`` then
``up``), each a contiguous block of the parameter's storage.

A parameter that holds several marks them as ``param.logical_parts``, a tuple of ``LogicalPart``
(name relative to the module that owns the parameter, flat offset, this rank's box of the logical
tensor, and the dim of the logical tensor split over TP, if any). Checkpoints, Hugging Face import
and export and the optimizer state's pieces name and store those logical tensors
(engine/checkpoint/specs.py), so they do not depend on how the parameters are stacked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogicalPart:
    name: str                       # e.g. "experts.3.fc1.weight", relative to the owning module
    start: int                      # flat offset of the block in the parameter
    shape: tuple[int, ...]          # this rank's box of the logical tensor
    shard_dim: int | None = None    # the logical tensor's dim split over TP (None: whole here)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """This part of ``t`` (the parameter, or any tensor of its numel laid out like it)."""
        return t.reshape(-1)[self.start:self.start + self.numel].view(self.shape)


def mark_parts(param: torch.nn.Parameter, parts) -> torch.nn.Parameter:
    """Record the logical tensors ``param`` holds; they must tile its storage in order."""
    parts = tuple(parts)
    at = 0
    for part in parts:
        if part.start != at:
            raise ValueError(f"logical part {part.name} starts at {part.start}, not {at}: the parts "
                             f"must tile the parameter in order")
        at += part.numel
    if at != param.numel():
        raise ValueError(f"logical parts cover {at} of the parameter's {param.numel()} elements")
    param.logical_parts = parts
    return param


def logical_views(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every logical tensor of ``module``'s parameters by its name relative to ``module``: a
    parameter holding parts gives one view per part, any other parameter itself."""
    out = {}
    for name, p in module.named_parameters():
        parts = getattr(p, "logical_parts", None)
        if not parts:
            out[name] = p
            continue
        prefix = name.rpartition(".")[0]
        for part in parts:
            out[f"{prefix}.{part.name}" if prefix else part.name] = part.view(p)
    return out
