"""Which operations make the host wait for a GPU or NPU, told from the operation and its arguments.

A host that waits cannot queue the next kernels, so a wait inside a step serializes host and
device. Most waits are not a visible ``.item()``: they hide inside ops whose output size or result
the host needs before it can go on. ``DeviceWaitMode`` (a ``TorchDispatchMode``) sees every aten
op of the thread that entered it, after autograd, forward and backward alike, and names the ones
that wait on a GPU or NPU:

- ``aten._local_scalar_dense``: a scalar read (``item``, ``bool``, ``int``, ``float`` of a tensor);
- ``aten.nonzero`` (``torch.where(cond)``, ``argwhere``), ``aten.masked_select``, ``aten.unique*``:
  an output size that only the data gives;
- ``aten.index`` / ``aten.index_put`` with a boolean mask (``x[mask]``, ``x[mask] = v``): a nonzero
  inside;
- ``aten.bincount``: the output length is max + 1, read on the host (CUDA reads min and max);
- ``aten.histc`` with min == max: the range is read from the data;
- ``aten.repeat_interleave`` with a repeats tensor and no ``output_size``: the sum is read;
- ``aten.equal``: a bool for the host;
- ``aten._to_copy`` / ``aten.copy_`` between the host and a device without ``non_blocking``: a
  blocking copy (device to host, and host to device from pageable memory).

The rule follows the op, not the kernel that happens to run it: on the CPU nothing waits, yet an
op counts as it would on a GPU, so a CPU test proves a GPU's count. Host tensors built from Python
data for the device (``torch.tensor(data, device=...)``, ``new_tensor``: a pageable copy on a GPU)
are seen by the patched functions of engine/device/syncs.py, since on the CPU no copy op is
dispatched for them. An op that a kernel calls inside another (``nonzero`` inside a boolean
``index``) is not dispatched again, so each wait counts once.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

_ALWAYS = {
    aten._local_scalar_dense: "aten._local_scalar_dense",
    aten.nonzero: "aten.nonzero",
    aten.argwhere: "aten.nonzero",
    aten.masked_select: "aten.masked_select",
    aten.bincount: "aten.bincount",
    aten.equal: "aten.equal",
    aten._unique: "aten.unique",
    aten._unique2: "aten.unique",
    aten.unique_dim: "aten.unique",
    aten.unique_consecutive: "aten.unique",
    aten.unique_dim_consecutive: "aten.unique",
}
_MASKED = (aten.index, aten._unsafe_index, aten.index_put, aten.index_put_, aten._index_put_impl_)
_COPIES = (aten._to_copy, aten.copy_, aten._copy_from)


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _copy_waits(func, args, kwargs) -> str | None:
    """A blocking copy between the host and a device (not to or from the meta device)."""
    if kwargs.get("non_blocking") or any(a is True for a in args[2:3]):
        return None
    if func.overloadpacket is aten._to_copy:
        src, device = args[0], kwargs.get("device")
        if device is None:
            return None
        dst_type = torch.device(device).type
    else:  # copy_(self=dst, src) / _copy_from(self=src, dst)
        dst, src = (args[0], args[1]) if func.overloadpacket is aten.copy_ else (args[1], args[0])
        if not isinstance(src, torch.Tensor):
            return None
        dst_type = dst.device.type
    kinds = {src.device.type, dst_type}
    if "meta" in kinds or len(kinds) == 1 or "cpu" not in kinds:
        return None
    return "device-to-host copy" if dst_type == "cpu" else "host-to-device copy"


def waits_for_device(func, args, kwargs) -> str | None:
    """The name of the host wait ``func(*args, **kwargs)`` makes on a GPU or NPU, or None."""
    packet = func.overloadpacket
    name = _ALWAYS.get(packet)
    if name is not None:
        return name
    if packet in _MASKED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return "boolean-mask indexing" if any(_is_mask(t) for t in indices or ()) else None
    if packet is aten.repeat_interleave:
        repeats = args[0] if func is aten.repeat_interleave.Tensor else (
            args[1] if len(args) > 1 else kwargs.get("repeats"))
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "aten.repeat_interleave without output_size"
        return None
    if packet is aten.histc:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return "aten.histc with its range from the data" if lo == hi else None
    if packet in _COPIES:
        return _copy_waits(func, args, kwargs)
    return None


class DeviceWaitMode(TorchDispatchMode):
    """Counts the ops of ``waits_for_device`` through ``on_wait(name)`` while ``active()``
    (a read already counted by a patched tensor method is not counted again). ``device_type``:
    the run's; off the CPU an op on host tensors alone waits for nothing (copies between host and
    device are named by ``waits_for_device`` itself)."""

    def __init__(self, on_wait, active=lambda: True, device_type: str = "cpu"):
        super().__init__()
        self.on_wait, self.active, self.device_type = on_wait, active, device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = waits_for_device(func, args, kwargs)
        if name is not None and self.active() and (
                self.device_type == "cpu" or func.overloadpacket in _COPIES
                or any(isinstance(t, torch.Tensor) and t.device.type == self.device_type
                       for t in tree_leaves((args, kwargs)))):
            self.on_wait(name)
        return func(*args, **kwargs)
