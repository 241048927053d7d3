"""The overlap model: how much of each overlapped transfer the compute beside it hides.

Pure arithmetic, no torch. Three overlaps, as the engine runs them (docs/planner.md, "Overlap"):

- **TP** (``Layout.tp_comm_overlap``, Megatron-LM's ``--tp-comm-overlap``; needs sequence
  parallelism): each layer's all-gather before a column-parallel GEMM and reduce-scatter after a
  row-parallel GEMM runs as a ring of tp chunks (parallel/tensor_parallel/ring.py), ``tp - 1``
  point-to-point steps of ``msg / tp`` bytes, chunk k+1 in flight while chunk k is multiplied; a
  step's transfer hides under its GEMM chunk up to the chunk's time (``tp_ring``). Forward: QKV
  and FC1 behind their gathers, the projection and FC2 before their scatters. Backward: the four
  input-gradient GEMMs, the column-parallel ones with the re-gather of their saved input in the
  same loop; a full recomputation repeats the four forward rings (``tp_layer_rings``).
- **DP** (``Layout.overlap_grad_reduce``): the gradient reduction per bucket under the last
  micro-batch's backward of every stage; the step waits for what exceeds that window, at least the
  last bucket (``bucketed``).
- **ZeRO** (``Layout.overlap_param_gather``): the parameter all-gather per bucket ahead of the layer
  that needs it in the next forward; the window is the stage's first forward, at least the first
  bucket is waited for (``bucketed``).

Each split is ``exposed = unhideable + (1 - e) x hideable`` with ``e`` the backend's efficiency for
that overlap (hardware.OverlapEfficiency; 1.0 for NCCL and HCCL, 0.0 for gloo, ``--calibrate``
fits it from a measured run: ``fit_efficiency``).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.plan.flops import _MLP_MATRICES
from engine.plan.model import ACT_BYTES, COLLECTIVE_LATENCY_S, Layout, ModelShape


@dataclass(frozen=True)
class Overlapped:
    """One transfer (or a sum of them), split into what the step waits for and what is hidden."""
    exposed: float = 0.0
    hidden: float = 0.0

    @property
    def total(self) -> float:
        return self.exposed + self.hidden

    def __add__(self, other: "Overlapped") -> "Overlapped":
        return Overlapped(self.exposed + other.exposed, self.hidden + other.hidden)

    def scale(self, k: float) -> "Overlapped":
        return Overlapped(self.exposed * k, self.hidden * k)


def split(transfer_s: float, unhideable_s: float, efficiency: float) -> Overlapped:
    """``transfer_s`` split: ``unhideable_s`` (clipped to [0, transfer_s]) is exposed, the rest is
    hideable and ``efficiency`` of it is hidden.

    >>> split(10.0, 2.0, 0.75)
    Overlapped(exposed=4.0, hidden=6.0)
    """
    unhideable = min(max(unhideable_s, 0.0), transfer_s)
    exposed = unhideable + (1.0 - efficiency) * (transfer_s - unhideable)
    return Overlapped(exposed, transfer_s - exposed)


def ring_step_s(nbytes: float, ranks: int, gbps: float) -> float:
    """One step of a TP chunk ring: ``nbytes / ranks`` to the next rank, plus one message latency."""
    return nbytes / ranks / (gbps * 1e9) + COLLECTIVE_LATENCY_S


def tp_ring(nbytes: float, ranks: int, gbps: float, gemm_s: float, efficiency: float,
            rings: int = 1) -> Overlapped:
    """``rings`` sequence-parallel all-gathers or reduce-scatters of ``nbytes`` each (the whole
    tensor), run in one ring loop of ``ranks`` steps beside a GEMM of ``gemm_s`` split into the
    same chunks (parallel/tensor_parallel/ring.py): at each of the first ``ranks - 1`` steps the
    rings' transfers travel while that step's GEMM chunk runs, and the next step waits for both;
    what a step's transfers take beyond its chunk, ``max(0, rings x step - gemm / ranks)``, is
    exposed.

    Worked example: 64 MiB over tp 8 at 360 GB/s, step = 8 MiB / 360 GB/s + 20 us = 43.30 us, ring
    7 steps = 303.1 us. Beside a 400 us GEMM (50 us chunks) all of it hides; beside a 200 us GEMM
    (25 us chunks) 7 x 18.30 = 128.1 us is exposed; the backward of a column-parallel layer runs
    two rings (its input gradient's reduce-scatter, its input's re-gather) in one loop:

    >>> r = tp_ring(64 * 2**20, 8, 360.0, 400e-6, 1.0); round(r.exposed * 1e6, 1), round(r.hidden * 1e6, 1)
    (0.0, 303.1)
    >>> round(tp_ring(64 * 2**20, 8, 360.0, 200e-6, 1.0).exposed * 1e6, 1)
    128.1
    >>> round(tp_ring(64 * 2**20, 8, 360.0, 400e-6, 1.0, rings=2).exposed * 1e6, 1)
    256.2
    """
    if ranks == 1:
        return Overlapped()
    step = rings * ring_step_s(nbytes, ranks, gbps)
    return split((ranks - 1) * step, (ranks - 1) * max(0.0, step - gemm_s / ranks), efficiency)


@dataclass(frozen=True)
class LayerRings:
    """A layer's TP ring loops per micro-batch, as (GEMM FLOPs of this rank beside the loop, rings
    in the loop), by pass; ``plain``: gathers left as plain all-gathers (nothing to hide behind)."""
    forward: tuple[tuple[float, int], ...]     # QKV, projection, FC1, FC2
    backward: tuple[tuple[float, int], ...]    # the four input-gradient GEMMs
    recompute: tuple[tuple[float, int], ...]   # full recomputation: the forward's four again
    plain: int = 0                             # zero-bubble W: the column inputs' re-gathers

    @property
    def rings(self) -> int:
        """TP collectives run as rings per layer and micro-batch (10 with 1F1B, no recomputation)."""
        return sum(k for _, k in self.forward + self.backward + self.recompute)


def tp_layer_rings(shape: ModelShape, layout: Layout, tokens: float) -> LayerRings:
    """Which GEMM hides which ring (parallel/tensor_parallel/overlap.py), as FLOPs of this TP rank
    over ``tokens`` tokens: QKV ``2 T h (h + 2 kv) / t``, projection ``2 T h h / t``, FC1
    ``2 T h f (n_mat - 1) / t`` (llama: gate and up), FC2 ``2 T f h / t``.

    Forward: QKV and FC1 behind their input's all-gather ring, the projection and FC2 before their
    output's reduce-scatter ring. Backward: each GEMM's input gradient (the forward's size) runs
    chunk by chunk; the column-parallel ones (QKV, FC1) carry two rings in one loop, the input
    gradient's reduce-scatter and the input's re-gather for the weight gradient (one GEMM on the
    gathered input afterwards), the row-parallel ones the output gradient's all-gather. Under a
    zero-bubble schedule B runs only the input-gradient rings and W re-gathers the column inputs
    with plain all-gathers. Full recomputation repeats the forward's rings.

    >>> from engine.plan.model import Layout, ModelShape
    >>> r = tp_layer_rings(ModelShape(2, 64, 4, 512, 32, 8), Layout(2, 1, 1, sequence_parallel=True), 32)
    >>> [(int(g), k) for g, k in r.forward], [k for _, k in r.backward], r.rings, r.plain
    ([(393216, 1), (131072, 1), (524288, 1), (524288, 1)], [2, 1, 2, 1], 10, 0)
    """
    t, h, f, kv = layout.tp, shape.hidden_size, shape.ffn_hidden_size, shape.kv_hidden
    qkv = 2 * tokens * h * (h + 2 * kv) / t
    proj = 2 * tokens * h * h / t
    fc1 = 2 * tokens * h * f * (_MLP_MATRICES[shape.block] - 1) / t
    fc2 = 2 * tokens * f * h / t
    forward = ((qkv, 1), (proj, 1), (fc1, 1), (fc2, 1))
    split_w = layout.schedule in ("zb-h1", "zb-v") and layout.pp > 1
    regather = 1 if split_w else 2
    backward = ((qkv, regather), (proj, 1), (fc1, regather), (fc2, 1))
    # Full recomputation repeats all four forward rings, early stop or not: the row-parallel ring
    # is one autograd.Function with FC2's GEMM, whose saved input is packed only once it returns,
    # so checkpoint's early stop comes after its ring (the dry run records 14 rings per layer).
    recompute = forward if layout.recompute == "full" else ()
    return LayerRings(forward, backward, recompute, 2 if split_w else 0)


def ring_recompute_extra_flops(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """FLOPs a full recomputation with early stop runs beyond flops.py's count under
    ``--tp-comm-overlap``: FC2's GEMM, inside the ring Function that the early stop cannot skip.

    >>> from engine.plan.model import Layout, ModelShape
    >>> ring_recompute_extra_flops(ModelShape(2, 64, 4, 512, 32, 8),
    ...                            Layout(2, 1, 1, recompute="full", sequence_parallel=True), 32)
    524288.0
    """
    if layout.recompute != "full" or not shape.recompute_early_stop:
        return 0.0
    return 2.0 * tokens * shape.ffn_hidden_size * shape.hidden_size / layout.tp


def tp_layer_overlap(shape: ModelShape, layout: Layout, tokens: float, gbps: float, rate: float,
                     efficiency: float) -> tuple[Overlapped, Overlapped, Overlapped]:
    """(forward, recompute, backward) TP communication of one layer and micro-batch with
    ``--tp-comm-overlap``: each ring's message is the activation, ``ACT_BYTES x tokens x h``, each
    GEMM runs at ``rate`` FLOP/s; a zero-bubble W's plain re-gathers are exposed (backward)."""
    from engine.plan.collectives import gather_or_scatter_s
    rings = tp_layer_rings(shape, layout, tokens)
    msg = ACT_BYTES * tokens * shape.hidden_size
    one = lambda g, k: tp_ring(msg, layout.tp, gbps, g / rate, efficiency, k)  # noqa: E731
    total = lambda loops: sum((one(g, k) for g, k in loops), Overlapped())  # noqa: E731
    plain = Overlapped(rings.plain * gather_or_scatter_s(msg, layout.tp, gbps), 0.0)
    return total(rings.forward), total(rings.recompute), total(rings.backward) + plain


def bucketed(transfer_s: float, window_s: float, bucket_s: float, efficiency: float) -> Overlapped:
    """A bucketed transfer beside a compute window: at least one bucket (``bucket_s``, the last DP
    bucket or the first ZeRO one) and whatever exceeds the window are exposed.

    >>> o = bucketed(0.41, 0.15, 0.01, 1.0); round(o.exposed, 6), round(o.hidden, 6)
    (0.26, 0.15)
    >>> o = bucketed(0.10, 0.15, 0.01, 0.5); round(o.exposed, 6), round(o.hidden, 6)
    (0.055, 0.045)
    """
    return split(transfer_s, max(transfer_s - window_s, min(bucket_s, transfer_s)), efficiency)


def stage_windows(backward_s: list[float]) -> list[float]:
    """Per pipeline stage, the compute the DP reduction of its gradients can hide under: its last
    micro-batch's backward, plus the backwards of the stages before it, which still run after it
    (1F1B's drain: the last backward moves from the last stage to the first, which ends the step).

    >>> stage_windows([3.0, 2.0, 2.0])
    [3.0, 5.0, 7.0]
    """
    out, before = [], 0.0
    for b in backward_s:
        out.append(b + before)
        before += b
    return out


def forward_windows(forward_s: list[float]) -> list[float]:
    """Per stage, the compute ZeRO's gather hides under: the stage's first forward, plus the
    forwards of the stages before it (their first micro-batch reaches it only after them).

    >>> forward_windows([1.0, 1.0, 2.0])
    [1.0, 2.0, 4.0]
    """
    return stage_windows(forward_s)


def fit_efficiency(measured_s: float, exposed_at_one: float, exposed_at_zero: float) -> float:
    """The efficiency at which the model's exposed time (linear in it: ``exposed_at_one`` with
    everything hideable hidden, ``exposed_at_zero`` with nothing) equals a measurement, in [0, 1].

    >>> fit_efficiency(0.3, 0.1, 0.5)
    0.5
    """
    span = exposed_at_zero - exposed_at_one
    if span <= 0:
        return 1.0
    return min(1.0, max(0.0, (exposed_at_zero - measured_s) / span))


def data_parallel_overlap(shape: ModelShape, cluster, layout: Layout, dp_gbps: float,
                          backward_s: list[float], forward_s: list[float],
                          edp_gbps: float = 0.0) -> tuple[Overlapped, Overlapped]:
    """(DP gradient reduction, ZeRO parameter all-gather) of one step, exposed and hidden.

    Every pipeline stage reduces its own gradients (``--grad-reduce-bytes`` per element) over its
    dp x cp ranks, an all-reduce or, under ZeRO, a reduce-scatter; with ``overlap_grad_reduce``
    under its window (``stage_windows`` of the stages' per-micro-batch ``backward_s``, pipeline
    order), at least its last bucket exposed; without it all of it after backward. ZeRO's bf16
    parameter all-gather likewise under ``forward_windows`` with ``overlap_param_gather``, at least
    the first bucket exposed. The step waits for the stage that is exposed longest. With ep > 1
    the experts' gradients (and ZeRO's gather of them) run over their EDP group at ``edp_gbps``
    after the dense ones, in the same window.
    """
    from engine.plan.collectives import allreduce_s, gather_or_scatter_s
    from engine.plan.memory import stage_param_split
    reducers, edp = layout.dp * layout.cp, layout.edp
    if reducers == 1:
        return Overlapped(), Overlapped()
    eff = cluster.overlap
    reduce_op = gather_or_scatter_s if layout.zero else allreduce_s
    windows_b, windows_f = stage_windows(backward_s), forward_windows(forward_s)
    dp = zero = Overlapped()
    for stage in range(layout.pp):
        params, expert = stage_param_split(shape, layout, stage)
        if layout.ep == 1:  # the experts' EDP group is the dp x cp group
            params, expert = params + expert, 0.0
        grads = (params + expert) * cluster.grad_reduce_bytes
        bucket = min(1.0, cluster.grad_bucket_bytes / grads) if grads else 1.0
        reduce = reduce_op(params * cluster.grad_reduce_bytes, reducers, dp_gbps)
        if expert and edp > 1:
            reduce += reduce_op(expert * cluster.grad_reduce_bytes, edp, edp_gbps)
        mine = (bucketed(reduce, windows_b[stage], reduce * bucket, eff.dp)
                if layout.overlap_grad_reduce else Overlapped(reduce, 0.0))
        dp = max(dp, mine, key=lambda o: o.exposed)
        if layout.zero and not layout.zero3:  # (ZeRO-3's gathers: zero3.py)
            gather = gather_or_scatter_s(params * ACT_BYTES, reducers, dp_gbps)
            if expert and edp > 1:
                gather += gather_or_scatter_s(expert * ACT_BYTES, edp, edp_gbps)
            mine = (bucketed(gather, windows_f[stage], gather * bucket, eff.zero)
                    if layout.overlap_param_gather else Overlapped(gather, 0.0))
            zero = max(zero, mine, key=lambda o: o.exposed)
    return dp, zero
