"""The fused communication-compute ops behind ``--tp-comm-overlap``, per backend, probed.

NOT YET RUN: written against the documented APIs; only the chunked ring (ring.py) has run (gloo,
CPU). ``probe_mode`` tries the symmetric-memory rendezvous once at start, on every rank of the TP
group (PyTorch's own tests of these ops require peer access between the devices); where any rank
fails it, the run uses the ring and says so in one line. ``fused_path(t, group, mode)`` returns the fused implementation for a tensor's device and
the group's backend, or None for the ring:

- CUDA on NCCL, where the installed torch registers them (``torch.distributed._symmetric_memory``):
  ``torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=)``
  and ``fused_matmul_reduce_scatter(A, B, "sum", scatter_dim, group_name)``, both with
  gather/scatter dim 1 (the sequence of (b, s, h)), on a group enabled for symmetric memory.
- Ascend on HCCL: ``torch_npu.npu_all_gather_base_mm(x1, x2, hcom, world_size, gather_output=)``
  -> (x1 gathered @ x2, x1 gathered) and ``npu_mm_reduce_scatter_base(x1, x2, hcom, world_size,
  reduce_op="sum")``, through the group's ``get_hccl_comm_name``. Documented (op-plugin 7.3.0
  docs/context/torch_npu-npu_all_gather_base_mm.md, -npu_mm_reduce_scatter_base.md; the chip
  table, engine/device/chips.py ``TP_OVERLAP_OPS``): Atlas A2 (2, 4, 8 ranks, HCCS full mesh)
  and A3 (2 to 32 ranks) training series, fp16/bf16, 2-D operands with k in [256, 65535), m
  divisible by the world size, no bias. Both gather / scatter dim 0 of a 2-D operand, so a
  (b, s, h) activation is laid out rank-major ((n, b, s/n, h) flattened) around them. Which TP
  sizes a chip takes is the chip table's decision (the trainer passes mode "auto" only where
  ``tp_overlap_mode`` lists the size for that chip); per call the path checks dtype and k (and,
  as a safety bound, a size some generation documents: 2, 4, 8, 16, 32). A call outside those
  limits (fp32; a k below 256, as a backward may have where its forward had not: the column
  layer's backward reduce-scatters over the sum of its output widths, the row layer's gathers
  with k = out) runs the chunked ring (ring.py ``ring_pass``), which overlaps too: the caller
  has already chosen this path, so it would never take the ring itself.
  Without sequence parallelism (``--tp-comm-overlap --device npu``) the row-parallel GEMM and
  its all-reduce run as ``torch_npu.npu_mm_all_reduce_base(x1, x2, hcom, reduce_op="sum")``
  (op-plugin 7.3.0 docs/context/torch_npu-npu_mm_all_reduce_base.md: Atlas A2 only, fp16/bf16,
  x1 2-D or 3-D, x2 2-D (k, n); ``TP_OVERLAP_OPS`` holds A2's 2/4/8 ranks and k in
  [256, 65535), the limits of the MC2 family; a bias given to it would be added on every rank
  before the sum, so the layer adds its bias after). Outside those limits the plain GEMM and
  all-reduce run: there is no ring for an all-reduce that leaves every rank the whole sum. CUDA
  has no fused matmul-all-reduce in torch: there, and on CPU, the plain GEMM and all-reduce run.

Both fused families go around ``CommGroup``'s wrappers; each call is still checked against the
backend rules and counted (``_count``) as the collective it replaces.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from kernels.dispatch import device_kind, import_torch_npu
from parallel.tensor_parallel.mappings import _check_divisible
from parallel.tensor_parallel.ring import chunk_of, ring_pass

SEQ = 1
# a safety bound only: the sizes some generation documents (A2 2/4/8, A3 2-32); which of them a
# chip takes is engine/device/chips.py's ``TP_OVERLAP_OPS`` (the trainer's ``tp_overlap_mode``)
NPU_WORLD_SIZES = (2, 4, 8, 16, 32)
NPU_ALL_REDUCE_WORLD_SIZES = (2, 4, 8)   # npu_mm_all_reduce_base: Atlas A2 only
NPU_K_RANGE = (256, 65535)           # k in [256, 65535)
NPU_DTYPES = (torch.float16, torch.bfloat16)


def symm_mem_namespace():
    """``torch.ops.symm_mem`` (registered by importing torch.distributed._symmetric_memory)."""
    return torch.ops.symm_mem


@functools.lru_cache(maxsize=None)
def symm_mem_ops() -> bool:
    """Whether the installed torch registers the symmetric-memory fused ops."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  registers torch.ops.symm_mem
    except Exception:
        return False
    ns = torch.ops.symm_mem
    return all(hasattr(ns, op) for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"))


@functools.lru_cache(maxsize=None)
def npu_ops() -> bool:
    """Whether torch_npu (importable only on a machine with CANN) has the fused ops."""
    try:
        npu = import_torch_npu()
    except RuntimeError:
        return False
    return all(hasattr(npu, op) for op in ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base"))


@functools.lru_cache(maxsize=None)
def npu_all_reduce_op() -> bool:
    """Whether torch_npu has the fused matmul + all-reduce (used without sequence parallelism)."""
    try:
        return hasattr(import_torch_npu(), "npu_mm_all_reduce_base")
    except RuntimeError:
        return False


def _pg(group):
    return group.process_group or dist.group.WORLD


def _count(group, op: str, tensor: torch.Tensor) -> None:
    """Rules and counters for a collective a fused op performs (CommGroup's own bookkeeping)."""
    group._issue(op, tensor, tensors=[tensor], reduce_op=dist.ReduceOp.SUM if op != "all_gather" else None)


class SymmMemPath:
    """CUDA, NCCL: PyTorch's micro-pipelined symmetric-memory ops."""
    name = "symm_mem"

    def all_gather_matmul(self, shard, bs, group, gather: bool = False):
        """shard (b, s/n, k), bs [(k, o_i)] -> (gathered (b, s, k) or None, [(b, s, o_i)])."""
        _count(group, "all_gather", shard)
        a, outs = symm_mem_namespace().fused_all_gather_matmul(shard, list(bs), SEQ,
                                                              _pg(group).group_name, return_A=gather)
        return a, list(outs)

    def matmul_reduce_scatter(self, a, b, group):
        """a (b, s, k), b (k, o) -> (b, s/n, o): (a @ b) summed over the group, this rank's chunk."""
        _count(group, "reduce_scatter", a[..., :1].expand(*a.shape[:-1], b.shape[-1]))
        return symm_mem_namespace().fused_matmul_reduce_scatter(a, b, "sum", SEQ,
                                                                _pg(group).group_name)


class NpuMc2Path:
    """Ascend, HCCL: torch_npu's fused communication-compute (MC2) ops."""
    name = "npu_mc2"

    @staticmethod
    def _ok(x: torch.Tensor, k: int, group, sizes: tuple[int, ...] = NPU_WORLD_SIZES) -> bool:
        """Whether this call is inside the ops' documented limits: fp16/bf16, k in [256, 65535)
        and a group size some generation documents (the chip's own sizes are the chip table's)."""
        return (x.dtype in NPU_DTYPES and NPU_K_RANGE[0] <= k < NPU_K_RANGE[1]
                and group.size in sizes)

    @staticmethod
    def _hcom(group) -> str:
        rank = dist.get_rank()   # get_hccl_comm_name takes this process's global rank
        return _pg(group)._get_backend(torch.device("npu")).get_hccl_comm_name(rank)

    def all_gather_matmul(self, shard, bs, group, gather: bool = False):
        """shard (b, s/n, k), bs [(k, o_i)] -> (gathered (b, s, k) or None, [(b, s, o_i)]); outside
        the documented limits the all-gather ring, each arriving chunk's GEMMs under the next
        chunk's transfer."""
        n, (b, sc, k) = group.size, shard.shape
        if not self._ok(shard, k, group):
            return _ring_all_gather_matmul(shard, bs, group, gather)
        npu, widths = import_torch_npu(), [w.shape[-1] for w in bs]
        _count(group, "all_gather", shard)
        out, gathered = npu.npu_all_gather_base_mm(shard.reshape(-1, k), torch.cat(list(bs), dim=1),
                                                   self._hcom(group), n, gather_output=gather)
        out = out.view(n, b, sc, -1).movedim(0, 1).reshape(b, n * sc, -1)   # (b, s, sum o_i)
        if gather:
            gathered = gathered.view(n, b, sc, k).movedim(0, 1).reshape(b, n * sc, k)
        return (gathered if gather else None), list(out.split(widths, dim=-1))

    def matmul_reduce_scatter(self, a, b, group):
        """a (b, s, k), b (k, o) -> (b, s/n, o): (a @ b) summed over the group, this rank's chunk;
        outside the documented limits the reduce-scatter ring, each chunk's partial sum
        travelling while the next chunk's GEMM runs."""
        n, (bs, s, k) = group.size, a.shape
        _check_divisible(a, SEQ, n)
        if not self._ok(a, k, group):
            return ring_pass(group, partial=lambda c: chunk_of(a, c, n).matmul(b))
        rank_major = a.view(bs, n, s // n, k).movedim(1, 0).reshape(-1, k)  # (n b s/n, k)
        _count(group, "reduce_scatter", rank_major[:, :1].expand(-1, b.shape[-1]))
        out = import_torch_npu().npu_mm_reduce_scatter_base(rank_major, b, self._hcom(group), n,
                                                            reduce_op="sum")
        return out.view(bs, s // n, -1)                               # (b, s/n, o)

    def matmul_all_reduce(self, a, b, group):
        """a (b, s, k), b (k, o) -> (b, s, o): (a @ b) summed over the group (no bias), fused
        where documented, else the plain GEMM and all-reduce (no ring exists for it: every rank
        needs the whole sum, not a chunk of it)."""
        k = a.shape[-1]
        if not (self._ok(a, k, group, NPU_ALL_REDUCE_WORLD_SIZES) and npu_all_reduce_op()):
            y = a.matmul(b)
            group.all_reduce(y)
            return y
        _count(group, "all_reduce", a[..., :1].expand(*a.shape[:-1], b.shape[-1]))
        return import_torch_npu().npu_mm_all_reduce_base(a.contiguous(), b, self._hcom(group),
                                                         reduce_op="sum")


def _ring_all_gather_matmul(shard, bs, group, gather: bool):
    """The all-gather ring of ``shard`` (b, s/n, k) with each weight's GEMM on every chunk as it
    arrives (ring.py): (gathered (b, s, k) or None, [(b, s, o_i)]), chunks in sequence order."""
    n = group.size
    outs = [[None] * n for _ in bs]
    pieces = [None] * n

    def gemms(c: int, x_c: torch.Tensor) -> None:   # x_c (b, s/n, k): chunk c, any rank's
        for i, w in enumerate(bs):
            outs[i][c] = x_c.matmul(w)               # (b, s/n, o_i)
        if gather:
            pieces[c] = x_c
    ring_pass(group, shard, on_chunk=gemms)
    return (torch.cat(pieces, dim=SEQ) if gather else None), [torch.cat(o, dim=SEQ) for o in outs]


SYMM_MEM, NPU_MC2 = SymmMemPath(), NpuMc2Path()


def _symm_mem_rendezvous(group, device) -> None:
    """Enable symmetric memory on the group and rendezvous one small buffer over it: what the
    fused ops do on their first call, which needs peer access between the group's devices."""
    from torch.distributed import _symmetric_memory as symm_mem
    name = _pg(group).group_name
    symm_mem.enable_symm_mem_for_group(name)
    buf = symm_mem.empty(16, dtype=torch.float32, device=device)
    symm_mem.rendezvous(buf, name)


def probe_mode(group, device, mode: str = "auto") -> tuple[str, str | None]:
    """The overlap mode the TP group can run, decided once at start by every rank of the group:
    where ``mode`` is "auto" and the symmetric-memory fused ops would be chosen (CUDA, NCCL, ops
    registered), each rank tries the rendezvous (``agree``). Returns (mode, None), or ("ring",
    the one line that says why) where a rank failed it."""
    device = torch.device(device)
    if mode != "auto" or device.type != "cuda" or group.size == 1 or not symm_mem_ops() \
            or dist.get_backend(_pg(group)) != "nccl":
        return mode, None
    return agree(group, lambda: _symm_mem_rendezvous(group, device), mode)


def agree(group, attempt, mode: str) -> tuple[str, str | None]:
    """Every rank of ``group`` runs ``attempt()``; all get ``(mode, None)`` when it succeeded on
    every rank, else ("ring", a line naming the first rank that failed and why)."""
    why = None
    try:
        attempt()
    except Exception as exc:  # noqa: BLE001 - any failure means: not on these devices
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    failed = group.failures(why)
    if not failed:
        return mode, None
    rank, why = failed[0]
    return "ring", (f"--tp-comm-overlap: the TP group's devices cannot share symmetric memory "
                    f"(rank {rank}: {why}); the chunked ring overlaps the TP communication instead")


def fused_path(t: torch.Tensor, group, mode: str = "auto"):
    """The fused implementation for ``t``'s device and ``group``'s backend, or None (the ring).
    ``mode`` "ring" always answers None."""
    kind = device_kind(t)
    if mode == "ring" or kind == "cpu" or (group.pg is None and not group.world):
        return None
    backend = dist.get_backend(_pg(group))
    if kind == "cuda" and backend == "nccl" and symm_mem_ops():
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        enable_symm_mem_for_group(_pg(group).group_name)
        return SYMM_MEM
    if kind == "npu" and backend == "hccl" and npu_ops():
        return NPU_MC2
    return None
