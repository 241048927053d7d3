"""Which of a recorded step's collectives are overlapped with compute, and how.

The dry run records what a rank issues (record.py); this module sorts a role's step into the
engine's overlaps (the planner models each: engine/plan/overlap.py):

- **tp ring** (``--tp-comm-overlap`` with sequence parallelism): the layers' all-gathers before
  and reduce-scatters after their column- and row-parallel GEMMs run as rings of point-to-point
  steps (parallel/tensor_parallel/ring.py), ``tp - 1`` sends of ``1/tp`` of the tensor per ring,
  each beside a GEMM chunk: 10 rings per layer and micro-batch (4 forward; backward the 4
  input-gradient loops, the column-parallel ones also re-gathering their input), a full
  recomputation repeats the forward's (less the last with early stop). The recorded sends and
  receives on the tp group are these steps; ``expected_ring_sends`` is the planner's count
  (``tp_layer_rings``) for the role's layers and micro-batches, and a difference is noted;
- **tp** gathers, scatters and all-reduces that stay collectives (embedding, output layer, loss,
  sequence-parallel norms, a zero-bubble W's re-gathers, everything without the flag): exposed;
- **dp buckets** (``--overlap-grad-reduce``, the default): the gradient reductions over dp (x cp),
  one per bucket, launched during the last micro-batch's backward; the last bucket is waited for;
- **zero gathers** (``--overlap-param-gather``, the default, with ``--use-distributed-optimizer``;
  off under ``--compile``): the parameter all-gathers, one per bucket, ahead of the layer that
  needs it in the next forward (ZeRO-3: in every forward and again in the backward, each unit's
  prefetched under the one before it);
- **ep** (MoE layers): the count exchange and the dispatch and combine all-to-alls (the allgather
  dispatcher: its all-gathers and reduce-scatters), forward and backward: exposed (the engine waits for each before the experts or the combine run);
- **pp** and everything else (the tied embedding's and the statistics' all-reduces): exposed.

Worked example (tests/engine/dryrun/test_dryrun.py): tp 2, pp 2, dp 2, SP, ZeRO-1, 4 layers, 4
micro-batches, ``--tp-comm-overlap``: the first stage's 2 layers run 2 x 4 x 10 = 80 rings of one
send each (80 sends, 80 receives on tp); its 2 reduce-scatters and 2 all-gathers over dp are the
buckets.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

TP_RING_OPS = ("all_gather", "reduce_scatter")
DP_GROUPS = ("dp", "dp_cp", "edp")  # edp: the experts' buckets, reduced like the others


@dataclass(frozen=True)
class OverlapRow:
    what: str          # "tp ring", "tp", "dp buckets", "zero gathers", "ep", "pp", "other"
    ops: str           # the recorded operations, e.g. "all_gather/reduce_scatter"
    group: str
    calls: int
    bytes: int         # payload bytes handed over (a receive: what it landed)
    overlapped: bool
    how: str

    def as_dict(self) -> dict:
        return {"what": self.what, "ops": self.ops, "group": self.group, "calls": self.calls,
                "bytes": self.bytes, "overlapped": self.overlapped, "how": self.how}


def expected_ring_sends(shape, layout, layers: int, micro_batches: int) -> int:
    """Ring sends the layers of a rank issue in one step with ``--tp-comm-overlap`` (sequence
    parallelism), by the planner's count: rings per layer x (tp - 1) x layers x micro-batches.

    >>> from engine.plan.model import Layout, ModelShape
    >>> expected_ring_sends(ModelShape(4, 64, 4, 512, 32, 8), Layout(2, 2, 2, sequence_parallel=True), 2, 4)
    80
    """
    from engine.plan.overlap import tp_layer_rings
    return tp_layer_rings(shape, layout, 1).rings * (layout.tp - 1) * layers * micro_batches


def _bytes(c: dict) -> int:
    return c.get("received_bytes", c["bytes"])


def _row_key(c: dict, zero: bool) -> tuple[str, str]:
    """(row, group) of one recorded collective."""
    op, group = c["op"], c["group"]
    if group == "tp":
        return ("tp ring" if op in ("send", "recv") else "tp"), group
    if group in DP_GROUPS and op in ("all_reduce", "reduce_scatter"):
        return "dp buckets", group
    if group in DP_GROUPS and op == "all_gather" and zero:
        return "zero gathers", group
    return (group if group in ("pp", "ep") else "other"), group


ORDER = ("tp ring", "tp", "dp buckets", "zero gathers", "ep", "pp", "other")


def overlap_rows(collectives: list[dict], *, tp: int, ring: bool, overlap_grad_reduce: bool,
                 overlap_param_gather: bool, zero: bool, zero3: bool = False) -> list[OverlapRow]:
    """A role's recorded step sorted into its overlaps (module docstring); ``ring``: the layers'
    TP collectives run as chunk rings (--tp-comm-overlap with sequence parallelism); ``zero3``:
    the parameters are sharded (ZeRO-3)."""
    calls, size, ops = Counter(), Counter(), {}
    for c in collectives:
        key = _row_key(c, zero)
        calls[key] += 1
        size[key] += _bytes(c)
        names = ops.setdefault(key, [])
        if c["op"] not in names:
            names.append(c["op"])
    hows = {
        "tp ring": (True, f"--tp-comm-overlap: the layers' gathers and scatters as rings of {tp - 1} "
                          f"step{'s' if tp > 2 else ''} of 1/{tp} each, every step beside a GEMM chunk"),
        "tp": (False, "exposed (embedding, output layer, loss, sequence-parallel norms; "
                      + ("a zero-bubble W's re-gathers)" if ring else
                         "the layers' too: --tp-comm-overlap with --sequence-parallel rings them)")),
        "dp buckets": (overlap_grad_reduce,
                       "per bucket during the last micro-batch's backward, the last bucket waited "
                       "for" if overlap_grad_reduce else "exposed (--no-overlap-grad-reduce: after "
                                                          "backward)"),
        "zero gathers": (overlap_param_gather,
                         ("ZeRO-3: per bucket in each forward and backward, each block's "
                          "prefetched under the one before it" if zero3 else
                          "per bucket ahead of the layer that needs it in the next forward")
                         if overlap_param_gather else
                         "exposed (ZeRO-3: each block's gathered when it starts)" if zero3 else
                         "exposed (waited for after the update)"),
        "ep": (False, "exposed (MoE dispatch: count exchange, token all-to-alls or gathers each way)"),
        "pp": (False, "exposed (blocking pipeline transfers)"),
        "other": (False, "exposed"),
    }
    return [OverlapRow(key[0], "/".join(ops[key]), key[1], calls[key], size[key], *hows[key[0]])
            for key in sorted(calls, key=lambda k: (ORDER.index(k[0]), k[1]))]


def role_overlap(record, cfg, grid, tp_comm_overlap: bool, num_micro: int, planned,
                 compiled: bool = False) -> tuple[list[OverlapRow], str | None]:
    """(the overlap rows of one recorded role, a note when its ring sends differ from the
    planner's count or None). ``planned``: ``planner_inputs``' (shape, layout), or a string when
    the planner has no formulas for the block; ``compiled``: the run uses --compile (its parameter
    gathers are waited for at once)."""
    par = cfg.parallel
    ring = tp_comm_overlap and par.sequence_parallel and grid.tp > 1
    rows = overlap_rows(record.collectives, tp=grid.tp, ring=ring,
                        overlap_grad_reduce=par.overlap_grad_reduce,
                        overlap_param_gather=par.overlap_param_gather and not compiled,
                        zero=par.use_distributed_optimizer,
                        zero3=par.use_distributed_optimizer and par.zero_stage == 3)
    note = None
    if ring and not isinstance(planned, str):
        shape, layout = planned
        layers = sum(len(r) for r in record.role.chunks)
        want = expected_ring_sends(shape, replace(layout, tp_comm_overlap=True), layers, num_micro)
        sent = sum(1 for c in record.collectives if c["group"] == "tp" and c["op"] == "send")
        if sent != want:
            note = (f"{record.role.name}: {sent} TP ring sends recorded, the planner counts {want} "
                    f"({layers} layers x {num_micro} micro-batches)")
    return rows, note
