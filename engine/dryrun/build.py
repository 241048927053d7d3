"""One rank of a large layout, built in this process by the run's own code, holding no memory.

``fake_rank(rank, world_size)`` makes this process that rank of a job of ``world_size`` under
torch.distributed's fake process group (``torch.testing._internal.distributed.fake_pg``, torch
2.13; no public successor yet): every collective and point-to-point transfer is accepted and
completes at once without moving data, so no other rank needs to exist. It is registered for the
cpu and the meta device, so that meta tensors can be handed to it. One process is one rank at a
time: the group is destroyed at the end of the block and the next role re-creates it.

``build_rank`` then creates the rank's process groups with ``ParallelState.initialize`` (every group
of the grid, as a run does; about 0.2 s at 8,192 ranks) and the expert groups with
``init_expert_groups``, and builds its model chunks, reducer,
optimizer and step with ``engine.training.trainer.Trainer.assemble`` under ``torch.device("meta")``:
parameters, gradient buffers and optimizer state are meta tensors, so their bytes come from shapes
and dtypes and nothing is allocated. Weight initialisation draws nothing on the meta device.

``HostReads`` stands in for the values a meta tensor does not have during the step: a host read
(``tolist``, ``item``, ``float``, ...) of a meta tensor reads zeros (a loss of 0, no overflow, a
gradient norm of 0, so the step is applied and clipping does nothing), and a tensor made from host
values for the meta device (``torch.tensor(values, device=...)``) stays on the CPU with its values
(the pipeline phase's first and last instants, which the bubble's all-reduce exchanges). A
mixture-of-experts layer's routing counts are the one exception to "zeros": they carry the values
of balanced routing, and so does the index arithmetic on them (assumed.py), so that the dispatch
moves the rows a balanced run moves. Nothing else of the step is replaced.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from engine.device.runtime import DeviceInfo
from engine.dryrun import assumed
from parallel.dp.policy import CompressionPolicy
from parallel.expert_parallel import init_expert_groups
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid

FAKE_BACKEND = "cpu:fake,meta:fake"
META = torch.device("meta")
# the dry run's device: meta tensors, CPU host clock, transfers waited for on the host
META_DEVICE = DeviceInfo("cpu", META, FAKE_BACKEND, "meta (dry run)")


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as ``rank`` of ``world_size`` under the fake process group, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("engine.dryrun needs a process without a process group (it creates a "
                           "fake one per rank role)")
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank(cfg, grid: RankGrid, launch: LaunchEnv, rules: str | None, registry=None,
               observer=None):
    """The ``Trainer`` parts of global rank ``launch.rank`` on the meta device (inside
    ``fake_rank``): ``.ps``, ``.chunks``, ``.reducer``, ``.optimizer``, ``.memory``, ``.stepper``.
    ``observer`` sees the collectives of the setup (the pipeline's and the ring's first
    all-reduce), and stays attached."""
    from engine.training.trainer import Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the layout's notes were said once, by validation
        compressed = CompressionPolicy.coerce(cfg.compression).any_compressed
        ps = ParallelState.initialize(grid, META, FAKE_BACKEND, launch,
                                      timeout_s=cfg.parallel.timeout_s, backend_rules=rules,
                                      dp_exchange=compressed)
        # mixture of experts: the EP and EDP groups, as the trainer makes them after the others
        init_expert_groups(ps, cfg.parallel.expert_model_parallel_size, cfg.parallel.timeout_s,
                           cfg.parallel.expert_tensor_parallel_size, exchange=compressed)
        if observer is not None:
            ps.comm.observers.append(observer)
        with torch.device(META):
            return Trainer.assemble(cfg, ps, META_DEVICE, registry)


_READS = {torch.Tensor.tolist: lambda t: assumed.read(t).tolist(),
          torch.Tensor.item: lambda t: assumed.read(t).item(),
          torch.Tensor.__bool__: lambda t: bool(assumed.read(t)),
          torch.Tensor.__float__: lambda t: float(assumed.read(t)),
          torch.Tensor.__int__: lambda t: int(assumed.read(t))}


def _run(func, args, kwargs):
    return func(*args, **kwargs)


class HostReads(TorchFunctionMode):
    """Host reads of meta tensors read zeros (routing counts: their assumed values, assumed.py);
    host values made for the meta device stay on the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = _READS.get(func)
        if read is not None and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type == "meta":
            return read(args[0])
        if func is torch.tensor and torch.device(kwargs.get("device") or "cpu").type == "meta":
            kwargs = dict(kwargs, device="cpu")
        out = assumed.call(func, args, kwargs, _run)
        return func(*args, **kwargs) if out is NotImplemented else out
