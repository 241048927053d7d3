"""Values the dry run assumes for the few meta tensors whose values decide shapes: MoE routing.

A meta tensor has a shape and no values, which is all a dense step needs. A mixture-of-experts
layer (models/moe/layer.py, parallel/expert_parallel/dispatch.py) is different: how many rows each
expert gets, and so the split sizes of the dispatch all-to-alls and the shapes after them, are
values, counted on the device (``parallel.expert_parallel.count_per_expert``: a ``scatter_add_``
of ones into E zeros) and read on the host under expert parallelism. The dry run assumes
**balanced routing**: every expert receives ``T K / E`` of a rank's ``T K`` assignments (the
remainder one each to the lowest experts), the figure a trained router's balancing aims at. So:

- ``Tensor.scatter_add_`` along dim 0 into a 1-D integer meta tensor of E bins, with n meta
  indices that carry no values (the count of assignments per expert), leaves it carrying the
  balanced counts (its ``assumed`` CPU values); so does ``torch.bincount`` of such indices with
  ``minlength=E``;
- ``torch.arange`` on the meta device of at most ``LIMIT`` integers carries its values;
- any other torch function whose meta tensor arguments all carry values runs on those values
  (on the CPU) as well, and its meta result carries the result, so index arithmetic on counts
  keeps values (``view``, ``sum``, ``repeat``, ``repeat_interleave`` and ``argsort``, whose output
  shape the values decide, are taken from the CPU result); a function with any meta argument
  without values runs on the meta device alone, as before;
- ``torch.empty_like`` of a tensor with values carries a copy of them: an empty buffer may hold
  anything, and with balanced routing the count exchange (an equal-split all-to-all, which the
  fake process group leaves untouched) lands exactly what each rank sends;
- a host read (``tolist``, ``item``, ...) of a tensor with values reads them; of any other meta
  tensor, zeros (build.py).

So the dry run's dispatch sends ``T K`` rows per layer and micro-batch, ``T K / ep`` to each EP
peer, as a balanced run does: its all-to-all bytes are the balanced ones, which the planner's
traffic model prices (engine/plan/traffic.py). Capacity without padding (the kept count read on the
host from the drop decision) is not assumed: the dry run refuses it (``check_supported``).
"""
from __future__ import annotations

import torch

META_TYPE = "meta"
LIMIT = 1 << 20  # elements: values are carried for index vectors, never for activations
ATTR = "_dryrun_assumed"


def assumed(t) -> torch.Tensor | None:
    """The CPU values a meta tensor carries, or None."""
    return getattr(t, ATTR, None) if isinstance(t, torch.Tensor) else None


def _carry(meta: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if values.numel() <= LIMIT and tuple(meta.shape) == tuple(values.shape):
        setattr(meta, ATTR, values)
    return meta


def balanced_counts(n: int, bins: int) -> torch.Tensor:
    """n assignments over ``bins`` experts, balanced: n // bins each, the remainder one each to the
    lowest.

    >>> balanced_counts(10, 4).tolist()
    [3, 3, 2, 2]
    """
    base, extra = divmod(n, bins)
    return torch.tensor([base + (i < extra) for i in range(bins)], dtype=torch.long)


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _on_cpu(a):
    values = assumed(a)
    if values is not None:
        return values
    if isinstance(a, (list, tuple)):
        return type(a)(_on_cpu(x) for x in a)
    return a


def _meta_like(values):
    if isinstance(values, torch.Tensor):
        return _carry(torch.empty(values.shape, dtype=values.dtype, device=META_TYPE), values)
    if isinstance(values, (list, tuple)):
        return type(values)(_meta_like(v) for v in values)
    return values


def _attach(meta_out, cpu_out):
    """``meta_out`` (one tensor or a tuple of them) carrying ``cpu_out``'s values."""
    if isinstance(meta_out, torch.Tensor) and isinstance(cpu_out, torch.Tensor):
        return _carry(meta_out, cpu_out)
    if isinstance(meta_out, (list, tuple)) and isinstance(cpu_out, (list, tuple)) \
            and len(meta_out) == len(cpu_out):
        for m, c in zip(meta_out, cpu_out):
            _attach(m, c)
    return meta_out


def _device_is_meta(kwargs) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == META_TYPE


def call(func, args, kwargs, run):
    """``func(*args, **kwargs)`` under the rules of the module docstring; ``run`` calls a function
    (the mode's own dispatch). Returns NotImplemented when no rule applies."""
    if func is torch.Tensor.scatter_add_ and _counting(args, kwargs):
        out = run(func, args, kwargs)
        counts = balanced_counts(args[2].numel(), args[0].numel()).to(args[0].dtype)
        return _carry(out, counts)
    if func is torch.bincount and args and isinstance(args[0], torch.Tensor) \
            and args[0].device.type == META_TYPE \
            and assumed(args[0]) is None and kwargs.get("weights") is None \
            and (len(args) < 2 or args[1] is None):  # (input, weights=None, minlength=0)
        bins = max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0)), 1)
        counts = balanced_counts(args[0].numel(), bins)
        return _meta_like(counts)
    if func is torch.arange and _device_is_meta(kwargs):
        out = run(func, args, kwargs)
        if out.numel() <= LIMIT and not out.is_floating_point():
            cpu = run(func, args, {k: v for k, v in kwargs.items() if k != "device"})
            _carry(out, cpu)
        return out
    metas = [t for t in _tensors(args, kwargs) if t.device.type == META_TYPE]
    if not metas or any(assumed(t) is None for t in metas):
        return NotImplemented
    if func in (torch.empty_like, torch.Tensor.new_empty):
        out = run(func, args, kwargs)
        return _carry(out, assumed(args[0]).clone()) if func is torch.empty_like else out
    cpu_kwargs = {k: _on_cpu(v) for k, v in kwargs.items() if k != "device"}
    cpu_out = run(func, tuple(_on_cpu(a) for a in args), cpu_kwargs)
    try:
        out = run(func, args, kwargs)
    except (NotImplementedError, RuntimeError):  # a data-dependent shape: the values decide it
        return _meta_like(cpu_out)
    return _attach(out, cpu_out)


def _counting(args, kwargs) -> bool:
    """``counts.scatter_add_(0, index, src)``: counts a 1-D integer meta tensor, index a meta
    tensor without values (the assignments' experts)."""
    if len(args) < 3 or kwargs:
        return False
    counts, dim, index = args[0], args[1], args[2]
    return (isinstance(counts, torch.Tensor) and counts.device.type == META_TYPE
            and counts.dim() == 1 and not counts.is_floating_point() and dim == 0
            and isinstance(index, torch.Tensor) and index.device.type == META_TYPE
            and assumed(index) is None and assumed(counts) is None)


def read(t: torch.Tensor):
    """The values a host read of ``t`` sees: what it carries, else zeros of its shape."""
    values = assumed(t)
    return values if values is not None else torch.zeros(t.shape, dtype=t.dtype)


def check_supported(cfg) -> None:
    """ConfigError (one line) for an MoE configuration whose shapes the assumed routing cannot
    give: a capacity without padding keeps a number of assignments that the drop decision, a
    comparison of router weights, decides on the host."""
    from engine.base import ConfigError
    m = cfg.model
    if m.num_experts is not None and m.moe_expert_capacity_factor is not None \
            and not m.moe_pad_expert_input_to_capacity:
        raise ConfigError("the dry run cannot tell which assignments --moe-expert-capacity-factor "
                          "drops without padding (the kept count is read from the router's "
                          "weights): add --moe-pad-expert-input-to-capacity, or dry-run it "
                          "dropless (no capacity factor)")
