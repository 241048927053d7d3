"""What HCCL and NCCL accept, as data: dtypes per collective, reduce ops, missing operations.

gloo, which runs every test, accepts almost anything (float64, int16, ``gather``, tensors inside
object collectives); the accelerator backends do not, and their refusals only show on the cluster,
after the job is queued and started. ``parallel.runtime.comm`` checks every collective the engine
issues against one of these rule sets before handing it to the backend, so the CPU suite fails where
the real backend would. ``ParallelState`` is built with ``backend_rules`` ("hccl", "hccl:950",
"nccl" or None); on an NPU or GPU the backend's own rules apply by default (``resolve``).

Sources (the table below transcribes them; cite them when changing an entry):

- HCCL: the CANN collective-communication API reference ("HcclAllReduce", "HcclReduceScatter",
  "HcclAllGather", "HcclBroadcast", "HcclAlltoAll", "HcclSend"/"HcclRecv", hcclcpp_07_00xx pages,
  CANN 8.x/9.x), Atlas A2/A3 training series: AllReduce and ReduceScatter take int8, int16, int32,
  int64, float16, float32, bfp16 with op sum, prod, max, min ("prod" not for int16 or bfp16);
  AllGather, Broadcast, Send/Recv and AlltoAll also take the unsigned types and float64. Float64
  reductions exist only on the Ascend 950 generation ("Atlas 350"). torch_npu's ProcessGroupHCCL
  enforces the reduction set (``checkSupportedDataTypeOfAllReduce``: "HCCL AllReduce & Reduce:
  Unsupported data type"), maps ``ReduceOp`` SUM/PRODUCT/MIN/MAX (no bitwise ops) and throws
  "ProcessGroupHCCL does not support gather". Complex tensors: no HCCL data type. Versions:
  the unsigned 16/32/64-bit types reach HCCL from torch_npu 2.6.0 (``HCCLUtils.cpp``
  ``kScalarTypeToHcclDataType``; earlier releases throw "Unsupported data type for HCCL process
  group"), the 950's float64/uint64 reductions only where torch_npu lists them
  (``a5ExtraDataTypes``: 2.7.1, 2.9.0); recent releases run AVG as a sum and a division, which
  these rules still refuse (the stricter set, as the engine never needs AVG). The engine sends
  none of those types, so the rules do not depend on the installed torch_npu. ``HcclBatchSendRecv``
  (torch_npu's ``batch_isend_irecv``): "the task list must not contain duplicate sending or
  receiving tasks pointed to the same rank" (``check_batch``).
- NCCL: ``ncclDataType_t`` (NCCL API, "Types") has int8, uint8, int32, uint32, int64, uint64,
  float16, float32, float64, bfloat16 (and fp8 in 2.24+): no int16 or complex, which PyTorch's
  ProcessGroupNCCL rejects ("Unsupported data type for NCCL process group"); ``ncclRedOp_t`` is
  sum, prod, max, min, avg (2.10+): no bitwise ops. bool travels as uint8 (sum mapped to max).
- Object collectives (``all_gather_object``, ``broadcast_object_list``) pickle their objects; a
  device tensor inside is pickled with its device and unpickled on the receiver's copy of that
  device index, or fails there. Both rule sets refuse tensors inside objects: send tensors with the
  tensor collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
_UINTS = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
_FLOATS = (torch.float16, torch.float32, torch.bfloat16)

_HCCL_REDUCE = frozenset(_INTS + _FLOATS)
_HCCL_MOVE = frozenset(_INTS + _UINTS + _FLOATS + (torch.float64, torch.bool))
_NCCL = frozenset((torch.int8, torch.uint8, torch.int32, torch.uint32, torch.int64, torch.uint64,
                   torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.bool))

# The collectives parallel.runtime.comm issues, by kind: reductions combine values, moves only copy
# them.
REDUCTIONS = ("all_reduce", "reduce_scatter")
MOVES = ("all_gather", "broadcast", "all_to_all", "send", "recv")
OPS = REDUCTIONS + MOVES + ("barrier", "gather", "object")


@dataclass(frozen=True)
class RuleSet:
    """One backend (and chip generation): accepted dtypes per collective, reduce ops, missing ops."""
    name: str
    dtypes: dict                      # collective -> frozenset of dtypes
    reduce_ops: frozenset             # names: sum, prod, max, min, avg
    no_prod: frozenset = frozenset()  # dtypes whose "prod" reduction is refused
    missing: frozenset = frozenset()  # collectives the backend does not implement
    one_p2p_per_peer: bool = False    # a batch holds at most one send to, one receive from a peer
    # a batch's first tensor alone is kept alive until it completes: torch_npu's
    # ProcessGroupHCCL::batch_isend_irecv hands {tensors[0]} to collective(), which records the
    # tensors on the HCCL stream, the others by pointer (the stream checker then checks theirs)
    batch_keeps_first: bool = False
    source: str = ""
    # calls already found allowed: (op, group, dtypes, reduce op) -> checked once, not per call
    passed: set = field(default_factory=set, compare=False, repr=False)


def _hccl(name: str, reduce_dtypes: frozenset, source: str) -> RuleSet:
    dtypes = {op: reduce_dtypes for op in REDUCTIONS}
    dtypes.update({op: _HCCL_MOVE for op in MOVES})
    return RuleSet(name, dtypes, frozenset({"sum", "prod", "max", "min"}),
                   no_prod=frozenset({torch.int16, torch.bfloat16}),
                   missing=frozenset({"gather"}), one_p2p_per_peer=True,
                   batch_keeps_first=True, source=source)


RULES: dict[str, RuleSet] = {
    # Atlas A2 / A3 training series (910B, 910C): the default for "hccl"
    "hccl": _hccl("hccl (Atlas A2/A3)", _HCCL_REDUCE,
                  "CANN HCCL API reference, HcclAllReduce/HcclReduceScatter data types for Atlas "
                  "A2/A3; torch_npu ProcessGroupHCCL checkSupportedDataTypeOfAllReduce"),
    # Ascend 950 (Atlas 350): float64 and uint64 reductions added
    "hccl:950": _hccl("hccl (Ascend 950)", _HCCL_REDUCE | {torch.float64, torch.uint64},
                      "CANN 9.0 HCCL API reference, HcclAllReduce data types for Atlas 350"),
    "nccl": RuleSet("nccl", {op: _NCCL for op in REDUCTIONS + MOVES},
                    frozenset({"sum", "prod", "max", "min", "avg"}),
                    source="NCCL API ncclDataType_t / ncclRedOp_t; PyTorch ProcessGroupNCCL"),
}


_RED_OP_TYPE = dist.ReduceOp.RedOpType


class BackendRuleError(RuntimeError):
    """A collective that the named backend would refuse (raised before it is issued)."""


def get_rules(name: str | None) -> RuleSet | None:
    """The rule set called ``name`` ("hccl", "hccl:950", "nccl"), or None for "none"/None."""
    if name in (None, "none", "off"):
        return None
    if name not in RULES:
        raise ValueError(f"unknown backend rules {name!r}; use one of none, {', '.join(RULES)}")
    return RULES[name]


def resolve(setting: str | None, backend: str, device_name: str = "") -> str | None:
    """The rule set a run uses: ``setting`` if explicit, else the backend's own ("auto").

    >>> resolve("auto", "gloo"), resolve("auto", "nccl"), resolve("auto", "hccl", "Ascend910B2")
    (None, 'nccl', 'hccl')
    >>> resolve("auto", "hccl", "Ascend950PR"), resolve("hccl", "gloo")
    ('hccl:950', 'hccl')
    """
    if setting not in (None, "auto"):
        get_rules(setting)
        return None if setting in ("none", "off") else setting
    if backend == "nccl":
        return "nccl"
    if backend == "hccl":
        return "hccl:950" if "950" in device_name.replace(" ", "") else "hccl"
    return None


def _reduce_op_name(op) -> str:
    import torch.distributed as dist
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MAX: "max",
             dist.ReduceOp.MIN: "min", dist.ReduceOp.AVG: "avg"}
    for key, name in names.items():
        if op == key:
            return name
    return str(op).rsplit(".", 1)[-1].lower()


def check(rules: RuleSet | None, op: str, group: str, tensors=(), reduce_op=None,
          cache: bool = True) -> None:
    """Raise BackendRuleError if ``rules`` refuse collective ``op`` over ``group`` on ``tensors``.
    ``cache=False`` inside a torch.compile trace (the caller knows; see below)."""
    if rules is None:
        return
    # A TP step issues hundreds of small collectives with a handful of distinct signatures: the
    # verdict depends only on these, so an allowed signature is checked once (a refused one raises
    # every time). A reduce op that is not a plain enum member (premul-sum) is never cached.
    # Inside a torch.compile trace the check runs once anyway, and mutating the cache there would
    # be a side effect Dynamo guards on: trace-time checks bypass it (parallel.runtime.comm passes
    # cache=False there).
    plain = cache and (reduce_op is None or isinstance(reduce_op, _RED_OP_TYPE))
    key = (op, group, tuple([t.dtype for t in tensors]), reduce_op) if plain else None
    if key is not None and key in rules.passed:
        return
    _check(rules, op, group, tensors, reduce_op)
    if key is not None:
        rules.passed.add(key)


def _check(rules: RuleSet, op: str, group: str, tensors, reduce_op) -> None:
    where = f"{op} over the {group} group"
    if op in rules.missing:
        raise BackendRuleError(f"{rules.name} does not implement {op} ({where}); use all_gather "
                               f"or a broadcast instead [{rules.source}]")
    allowed = rules.dtypes.get(op)
    for t in tensors:
        if t.is_complex():
            raise BackendRuleError(f"{rules.name} has no complex data type: {where} got a {t.dtype} "
                                   f"tensor of shape {tuple(t.shape)}; send torch.view_as_real(t)")
        if allowed is not None and t.dtype not in allowed:
            raise BackendRuleError(
                f"{rules.name} refuses {t.dtype} in {op}: {where} got a tensor of shape "
                f"{tuple(t.shape)}; use one of {', '.join(sorted(str(d)[6:] for d in allowed))} "
                f"[{rules.source}]")
    if reduce_op is not None:
        name = _reduce_op_name(reduce_op)
        if name not in rules.reduce_ops:
            raise BackendRuleError(f"{rules.name} has no reduce op {name!r} ({where}); use one of "
                                   f"{', '.join(sorted(rules.reduce_ops))}")
        if name == "prod":
            for t in tensors:
                if t.dtype in rules.no_prod:
                    raise BackendRuleError(f"{rules.name} refuses prod on {t.dtype} ({where})")


def check_batch(rules: RuleSet | None, group: str, transfers) -> None:
    """A ``batch_isend_irecv`` of ("send" | "recv", tensor, peer) ``transfers``: HCCL's
    HcclBatchSendRecv takes at most one send to and one receive from each peer per call."""
    if rules is None or not rules.one_p2p_per_peer:
        return
    seen = set()
    for kind, _, peer in transfers:
        if (kind, peer) in seen:
            way = "sends to" if kind == "send" else "receives from"
            raise BackendRuleError(
                f"{rules.name} refuses a batch_isend_irecv over the {group} group that {way} rank "
                f"{peer} twice: HcclBatchSendRecv takes one send to and one receive from each peer "
                f"per call (it reorders a call's tasks); post them in separate batches "
                f"[CANN HCCL API reference, HcclBatchSendRecv]")
        seen.add((kind, peer))


def check_object(rules: RuleSet | None, op: str, group: str, obj) -> None:
    """Object collectives may carry no tensors (see the module docstring)."""
    if rules is None:
        return
    found = _find_tensor(obj, depth=0)
    if found is not None:
        raise BackendRuleError(f"{op} over the {group} group carries a tensor ({found}): on "
                               f"{rules.name} a device tensor inside a pickled object lands on the "
                               f"wrong device or fails; send it with a tensor collective")


def _find_tensor(obj, depth: int) -> str | None:
    if isinstance(obj, torch.Tensor):
        return f"{obj.dtype} of shape {tuple(obj.shape)}"
    if depth > 8:
        return None
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return None
    for item in items:
        found = _find_tensor(item, depth + 1)
        if found is not None:
            return found
    return None
