"""Every figure of the dry run next to the planner's estimate for the same layout.

``planner_inputs`` (engine/training/validate.py, whose memory check at start uses it too) turns the
run's configuration into the planner's ``ModelShape`` and ``Layout`` (fused attention and
early-stopping recomputation, as the engine runs; activation and weight bytes from ``--precision``;
dropout masks only with ``--dropout`` > 0). ``compare_role`` puts the role's
representative next to the planner's device of the same pipeline rank (engine/plan/memory.py
``stage_memory``, engine/plan/traffic.py ``step_traffic``) and flags a difference above
``TOLERANCE``; with MoE layers also the EP dispatch's and the EDP reduction's bytes (the dry run's
routing is balanced, engine/dryrun/assumed.py, as the planner's is); under ZeRO-3 the peak of
gathered units (engine/plan/zero3.py), with ``--optimizer-cpu-offload`` the host memory
(engine/plan/offload.py); where the reason is known (the planner prices something this engine does not do,
or the other way round) the row says it. docs/planner.md, "Dry runs", lists them with figures.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.plan.memory import buffer_bytes, stage_memory, stage_param_split
from engine.plan.model import Layout, ModelShape
from engine.plan.offload import host_memory
from engine.plan.traffic import step_traffic

TOLERANCE = 0.05

# Known differences: (figure, condition on (cfg, layout), why)
_LLAMA = ("the planner counts Korthikanti et al.'s tensors and RoPE's q and k beside the whole QKV "
          "output; a llama layer of this engine on the portable kernels (which the meta device "
          "runs, as the CPU does) also keeps RMSNorm's fp32 copies of its input (bf16/fp16 runs) "
          "and SwiGLU's four tensors (gate, silu(gate), up, product); npu_rms_norm and npu_swiglu "
          "keep less")
KNOWN = (
    ("activation_bytes", lambda cfg, lay: cfg.model.block == "llama", _LLAMA),
    ("activation_bytes", lambda cfg, lay: lay.schedule in ("zb-h1", "zb-v"),
     "the planner keeps a micro-batch's whole activations until its W (an upper bound); after B "
     "only what W needs stays (the linears' inputs and output gradients)"),
    ("activation_bytes", lambda cfg, lay: cfg.model.num_experts is not None,
     "an MoE layer keeps its routing's index vectors and fp32 router tensors, which the planner "
     "counts per assignment and expert (ACT_MOE_*); the portable kernels' extra copies as above"),
    ("activation_bytes", lambda cfg, lay: cfg.model.dropout > 0,
     "the planner counts 1-byte dropout masks (CUDA's bool masks); on the CPU and the meta device, "
     "which the dry run runs, F.dropout keeps its mask in the activation's dtype (2 bytes in "
     "bf16/fp16)"),
    ("optimizer_state_bytes",
     lambda cfg, lay: getattr(cfg.compression, "grad_compression", "none") in ("topk", "onebit"),
     "the planner counts the compressors' residuals; the momentum compressors (topk, onebit) also "
     "keep their fp32 momentum (under ZeRO a seed shard until the first exchange, then the whole "
     "momentum and its previous copy)"),
    (("dp_comm_bytes", "comm_buffer_bytes"),
     lambda cfg, lay: getattr(cfg.compression, "grad_compression", "none") != "none"
     and getattr(cfg.compression, "grad_compression_warmup_steps", None) == 0,
     "the planner prices the uncompressed exchange (the warm-up's, which the dry run's step 1 is "
     "otherwise) and both DP communicators; a compressed step sends the compressor's messages "
     "on the exchange worker's communicator alone"),
    (("optimizer_state_bytes", "optimizer_state_host_bytes", "grad_host_bytes"),
     lambda cfg, lay: 0 < lay.offload < 1,
     "the engine offloads whole buckets, the first reduced, until at least "
     "--optimizer-offload-fraction of the shard is in host memory; the planner takes the fraction "
     "itself"),
)


@dataclass(frozen=True)
class Row:
    figure: str
    dry_run: float
    planner: float | None
    why: str = ""

    @property
    def difference(self) -> float | None:
        """(planner - dry run) / dry run; None when the planner has no figure."""
        if self.planner is None:
            return None
        if self.dry_run == 0:
            return 0.0 if self.planner == 0 else float("inf")
        return (self.planner - self.dry_run) / self.dry_run

    @property
    def flagged(self) -> bool:
        d = self.difference
        return d is not None and abs(d) > TOLERANCE


def _why(figure: str, cfg, layout: Layout) -> str:
    return "; ".join(text for names, cond, text in KNOWN
                     if (figure in names if isinstance(names, tuple) else names in (figure, "*"))
                     and cond(cfg, layout))


def compare_role(record, cfg, shape: ModelShape, layout: Layout, backend: str) -> list[Row]:
    """Rows for one role's representative (a record.RoleRecord)."""
    stage = record.stage
    mem = stage_memory(shape, layout, stage, backend)
    traffic = step_traffic(shape, layout, stage, cfg.parallel.cp_comm_type)
    buffers = buffer_bytes(record.communicators, record.p2p_peers, backend)
    m = record.metrics
    pairs = [("param_bytes", m["param_bytes"], mem.weights),
             ("grad_bytes", m["grad_bytes"], mem.grads),
             # the compressors' residuals are optimizer state in the run's count
             ("optimizer_state_bytes", m["optimizer_state_bytes"], mem.optimizer + mem.compression),
             ("activation_bytes", record.activation_bytes, mem.activations + mem.pipeline_ends),
             ("comm_buffer_bytes", buffers, mem.comm_buffers),
             ("tp_comm_bytes", m["tp_comm_bytes"], traffic["tp"]),
             ("cp_comm_bytes", m["cp_comm_bytes"], traffic["cp"]),
             ("pp_comm_bytes", m["pp_comm_bytes"], traffic["pp"]),
             ("dp_comm_bytes", m["dp_comm_bytes"], traffic["dp"] + traffic["edp"]),  # EDP's too
             ("embedding_comm_bytes", record.comm["embedding"]["payload_bytes"],
              traffic["embedding"])]
    if layout.zero3:  # the whole units gathered at once, beside the shards (engine/plan/zero3.py)
        pairs.append(("gathered_bytes", record.gathered_bytes, mem.gathered))
    if layout.offload:  # the optimizer's host memory (engine/plan/offload.py)
        host = host_memory(shape, layout, *stage_param_split(shape, layout, stage))
        pairs += [("optimizer_state_host_bytes", record.memory["optimizer_state_host_bytes"],
                   host.optimizer),
                  ("grad_host_bytes", record.memory["grad_host_bytes"], host.grads)]
    if shape.moe is not None:  # the dispatch all-to-alls (balanced routing) and the experts' EDP reduction
        pairs += [("ep_comm_bytes", record.comm["ep"]["payload_bytes"], traffic["ep"]),
                  ("edp_comm_bytes", record.comm["edp"]["payload_bytes"], traffic["edp"])]
    rows = []
    for name, dry, plan in pairs:
        row = Row(name, dry, plan)
        if row.flagged:
            row = Row(name, dry, plan, _why(name, cfg, layout) or "not explained")
        rows.append(row)
    return rows
