"""ZeRO-3's units: which buckets each block gathers and frees, and the hooks that do it.

A unit is what ``param_gather.gather_units`` returns for the overlapped ZeRO-1/2 gather (a model
chunk's own parameters, and each block of it: the embedding, every transformer layer, the final
norm, the output layer), FSDP's and Megatron-FSDP's unit. The reducer ends its buckets at unit
boundaries under ZeRO-3 (buffers.py), so a unit's buckets are its own.

- **Forward.** A unit's forward pre-hook gathers its buckets (or waits for the prefetch that
  started them), then starts the next unit's gathers (``overlap``: prefetch one unit ahead, in the
  chunk's module order, which is its forward order), so the next gather runs under this unit's
  compute; its forward post-hook frees its buckets. At most two units are gathered at once.
- **Backward.** A multi-grad hook on the unit's outputs (mode "any": when the first gradient
  reaches them, before any backward node of the unit runs) gathers the unit again and prefetches
  the unit before it; a multi-grad hook on the unit's inputs (mode "all": when the gradients of
  its inputs are complete, so every node that reads its weights has run) frees it. A callback at
  the end of the backward call frees what is left (a unit whose inputs need no gradient, such as
  the embedding, and a prefetch the backward did not reach). Every pipeline schedule runs
  backward per (chunk, micro-batch) call, so the same hooks serve 1F1B, interleaved and
  zero-bubble: a zero-bubble B is a backward call, its W reads no weight (it needs the layer's
  input and output gradient only: parallel/grads/weight_grad.py), so nothing is kept for it.
- **Recomputation.** ``--recompute`` re-runs a block's forward inside its backward, after the
  pre-backward gather: the weights it reads are the re-gathered ones. A unit whose forward runs
  inside a backward (a recomputation that calls the unit itself) is gathered and not freed by
  that forward; its post-backward hook frees it.
- **Shared parameters.** A parameter read by more than one unit (a tied output layer reads the
  embedding's weight: its ``foreign_parameters()``), the chunk's own parameters (the root unit,
  as FSDP's root) and parameters of modules without a forward of their own are kept gathered from
  their first read until the optimizer's step frees everything (``ShardedParams.wait_all``).

Every hook runs in the same order on every rank of a bucket's group (the program and its autograd
graph are the same there), so the ranks issue the same gathers in the same sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from parallel.dp.param_gather import gather_units


@dataclass(eq=False)
class Unit:
    module: nn.Module
    needs: list[int]                 # every bucket its forward reads (its own and shared ones)
    own: list[int]                   # those it gathers and frees itself (not kept gathered)
    next: "Unit | None" = None       # the unit after it in its chunk's forward order
    prev: "Unit | None" = None
    handles: list = field(default_factory=list)


def _foreign(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of other modules that ``module``'s subtree reads (``foreign_parameters()``)."""
    out = []
    for m in module.modules():
        fn = getattr(m, "foreign_parameters", None)
        if callable(fn):
            out += list(fn())
    return out


def _runs_forward(module: nn.Module) -> bool:
    """Whether the module has a forward of its own (a ParameterDict's parameters are read by
    someone else)."""
    return type(module).forward is not nn.Module.forward


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a forward's arguments or result that require grad."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def unit_index(modules) -> dict:
    """param -> the index of its gather unit in ``modules`` (the model chunks): the reducer's
    ``unit_of``, so that no bucket spans two units."""
    return {p: i for i, (_, params) in enumerate(gather_units(modules)) for p in params}


def plan_units(store, modules) -> tuple[list[Unit], set[int]]:
    """(the units of ``modules`` with the buckets they read, in module order per chunk; the
    buckets kept gathered: read by several units, by a chunk itself, or owned by a module without
    a forward)."""
    bucket_of = store.reducer.bucket_of
    chunks = list(modules.children()) if isinstance(modules, nn.ModuleList) else list(modules)
    reads: list[tuple[nn.Module, list[int], int]] = []
    readers: dict[int, int] = {}
    kept: set[int] = set()
    for c, chunk in enumerate(chunks):
        for module, params in gather_units([chunk]):
            own = {bucket_of(p).index for p in params if bucket_of(p) is not None}
            foreign = {bucket_of(p).index for p in _foreign(module) if bucket_of(p) is not None}
            if module is chunk or not _runs_forward(module):
                kept |= own
            for index in own | foreign:
                readers[index] = readers.get(index, 0) + 1
            # (bucket indices run in backward order: a unit's forward reads them in reverse)
            reads.append((module, sorted(own | foreign, reverse=True), c))
    kept |= {i for i, n in readers.items() if n > 1}
    units, last = [], None
    for module, needs, c in reads:
        if not needs:
            continue
        unit = Unit(module, needs, [i for i in needs if i not in kept])
        if last is not None and last[1] == c:   # prefetch within a chunk only
            last[0].next, unit.prev = unit, last[0]
        units.append(unit)
        last = (unit, c)
    return units, kept


class UnitHooks:
    """The hooks of every unit of ``modules`` over a ``ShardedParams`` store (module docstring)."""

    def __init__(self, store, modules):
        self.store = store
        self.units, self.kept = plan_units(store, modules)
        self._task = None          # the backward call whose end-of-backward callback is queued
        for unit in self.units:
            unit.handles = [
                unit.module.register_forward_pre_hook(self._pre_forward(unit)),
                unit.module.register_forward_hook(self._post_forward(unit))]

    def remove(self) -> None:
        for unit in self.units:
            for h in unit.handles:
                h.remove()
            unit.handles = []

    def _prefetch(self, unit: Unit | None) -> None:
        if unit is not None and self.store.overlap:
            self.store.gather(unit.own)

    def _pre_forward(self, unit: Unit):
        def hook(module, args):
            self.store.ensure(unit.needs)
            if _in_backward():      # a recomputation: gathered, and kept until its backward ends
                return
            self._prefetch(unit.next)
            inputs = _tensors(args) if torch.is_grad_enabled() else []
            if inputs:              # its inputs' gradients complete: no node of it reads weights
                register_multi_grad_hook(inputs, lambda grads: self._post_backward(unit),
                                         mode="all")
        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            if _in_backward():
                return
            self.store.free(unit.own)
            outputs = _tensors(output) if torch.is_grad_enabled() else []
            if outputs:             # the first gradient reaching it: before its backward runs
                register_multi_grad_hook(outputs, lambda grad: self._pre_backward(unit),
                                         mode="any")
        return hook

    def _pre_backward(self, unit: Unit) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:      # once per backward call: free what it leaves gathered
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.store.ensure(unit.needs)
        self._prefetch(unit.prev)

    def _post_backward(self, unit: Unit) -> None:
        self.store.free(unit.own)

    def _end_of_backward(self) -> None:
        self._task = None
        self.store.free([i for i in self.store.gathered if i not in self.kept])
