"""The per-pass time unit of the step-time model and the link rates of a layout (timing.py):
``PassTime`` (one device, one micro-batch: a layer, a pipeline end or a whole stage, by kind of
work), ``Links`` and ``layout_links`` (the GB/s each group of a layout gets from the ranks it
spans, placement.py), and the compute and memory-bound rates of a cluster."""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.plan.model import HBM_EFFICIENCY, Cluster, Layout
from engine.plan.placement import (collective_busbw, expert_groups_of_rank0, group_of_rank0,
                                   p2p_gbps)


@dataclass(frozen=True)
class Links:
    """GB/s each group of a layout gets, from the ranks it spans (placement.py)."""
    tp: float
    cp: float  # per-device rate of the ring's p2p
    pp: float  # per-device rate of pipeline p2p
    dp: float  # bus bandwidth of the gradient reduction over dp x cp ranks
    edp: float = 0.0  # of the expert gradients' reduction over the EDP group (0: no experts)
    ep: tuple = ()  # rank 0's EP group (the all-to-all's members; collectives.alltoall_s)


def layout_links(cluster: Cluster, layout: Layout) -> Links:
    dpn, intra, inter = cluster.devices_per_node, cluster.intra_busbw_gbps, cluster.inter_busbw_gbps
    group = lambda *dims: group_of_rank0(layout.order, layout.sizes, dims)  # noqa: E731
    ep_ranks, edp_ranks = expert_groups_of_rank0(layout.order, layout.sizes, layout.ep)
    return Links(collective_busbw(group("tp"), dpn, intra, inter),
                 p2p_gbps(group("cp"), dpn, intra, inter),
                 p2p_gbps(group("pp"), dpn, intra, inter),
                 collective_busbw(group("cp", "dp"), dpn, intra, inter),
                 collective_busbw(edp_ranks, dpn, intra, inter), ep_ranks)


@dataclass(frozen=True)
class PassTime:
    """Seconds of one device for one micro-batch (a layer, a pipeline end, or a whole stage)."""
    compute: float = 0.0  # forward + backward: matrices, memory-bound kernels, per-pass overheads
    recompute: float = 0.0  # the recomputed forward (full: the layer; selective: attention core)
    tp_comm: float = 0.0
    cp_comm: float = 0.0  # the ring exchange the attention core does not hide
    pp_comm: float = 0.0  # p2p sends and receives + the TP all-gather on receive
    backward: float = 0.0  # the part of the above that runs in backward (for the DP overlap)
    weight: float = 0.0  # the part of backward that is weight-gradient GEMMs (a zero-bubble W)
    cp_ring: float = 0.0  # the whole CP ring exchange, hidden or not (not in total: cp_comm is)
    tp_hidden: float = 0.0  # TP ring time hidden under the GEMMs (--tp-comm-overlap; not in total)
    ep_comm: float = 0.0  # MoE dispatch and combine, all-to-alls or gathers (exposed)
    moe_overhead: float = 0.0  # the MoE layers' kernel launches and host waits (moe_time.py)
    moe_imbalance: float = 0.0  # the busiest EP rank's extra expert and all-to-all time

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.cp_comm + self.pp_comm
                + self.ep_comm + self.moe_overhead + self.moe_imbalance)

    def __add__(self, other: "PassTime") -> "PassTime":
        return PassTime(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scale(self, k: float) -> "PassTime":
        return PassTime(*(getattr(self, f.name) * k for f in fields(self)))


def _rates(cluster: Cluster):
    rate = cluster.peak_tflops * 1e12 * cluster.achievable_fraction
    hbm = (cluster.device.hbm_gbps or 0) * 1e9 * HBM_EFFICIENCY
    return rate, (lambda nbytes: nbytes / hbm) if hbm else (lambda nbytes: 0.0)
