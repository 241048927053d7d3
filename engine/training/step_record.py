"""What a training step and a run report: the metrics record of one step (docs/design.md's keys and
their exact meanings), the resilience keys beside it, and the closing summary.

Every figure here is computed from what the step measured on the device (``dt``: the step's device
time; ``out``: engine.training.step.StepOutput) and from the trainer's fixed facts (FLOPs per step, the dense
peak, the exact bytes of parameters, gradients and optimizer state).
"""
from __future__ import annotations

from engine.observe.metrics import plot_metrics, summary_table
from engine.observe.utilization import per_device, utilization
from models.moe.step_figures import balancing_all_reduce, moe_record
from parallel.pipeline.bubble import simulate
from parallel.pipeline.schedules import has_weight_actions
from parallel.pipeline.transfers import StageTransfers

MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "optimizer_state_host_bytes",
               "grad_host_bytes")
TIMELINE_STEPS = 3  # the steps --timeline keeps (the trainer's)
# the keys read at the next step's wait (engine/training/late_figures.py): null until then
LATE_KEYS = ("step_time_s", "tokens_per_s", "tflops_per_device", "model_tflops_per_device", "mfu",
             "hfu", "time_clip_s", "time_optimizer_s", "bubble_measured", "bubble_simulated",
             "bubble_simulated_compute")
# late too, and null without a pipeline (like the bubbles): the exposed pipeline transfer time
PP_LATE_KEYS = ("time_pp_exposed_s",)


def comm_metrics(comm: dict, compiled: bool = False, dp_in_graph: bool = False) -> dict:
    """The step's bytes per traffic kind: payload handed to collectives (``*_comm_bytes``) and, for
    DP, the ring-model bytes on the wire. DP is the gradient/parameter group (DP x CP with context
    parallelism) and, under expert parallelism, the expert-data-parallel group its expert
    gradients and parameters go over (kind ``edp``); PP counts the activations and gradients this rank sends to its neighbours. TP and
    CP collectives inside compiled chunks are not counted (parallel/runtime/comm.py): null then,
    and the DP figures too where the compiled chunks hold a DP collective (``dp_in_graph``: the
    MoE global aux loss's all-reduce, models/moe/step_figures.py ``balancing_all_reduce``)."""
    def total(kinds, key):
        return sum(comm[k][key] for k in kinds)
    dp = ("dp", "dp_cp", "edp")
    dp_lost = compiled and dp_in_graph
    return {"dp_comm_bytes": None if dp_lost else total(dp, "payload_bytes"),
            "dp_comm_wire_bytes": None if dp_lost else total(dp, "wire_bytes"),
            "tp_comm_bytes": None if compiled else total(("tp",), "payload_bytes"),
            "cp_comm_bytes": None if compiled else total(("cp",), "payload_bytes"),
            "pp_comm_bytes": total(("pp",), "payload_bytes")}


def simulated_bubble(schedule_lists, out, transfers: bool = True) -> float | None:
    """The schedule replayed with this step's measured mean forward/backward (and weight-gradient)
    time per stage and, with ``transfers``, each stage's measured post time per transfer and mean
    receive latency (parallel/pipeline/transfers.py): the bubble of stage imbalance and
    transfers, without noise (``bubble_simulated``); ``transfers=False``: of stage imbalance
    alone (``bubble_simulated_compute``). None where a figure is missing."""
    if out.pipeline is None or "stage_fwd_s" not in out.extra:
        return None
    fwd, bwd, wgt = out.extra["stage_fwd_s"], out.extra["stage_bwd_s"], out.extra["stage_wgt_s"]
    if min(fwd) <= 0 or min(bwd) <= 0:
        return None
    p2p = post = 0.0
    if transfers:
        if "stage_post_s" not in out.extra:
            return None
        costs = StageTransfers(out.extra["stage_post_s"], out.extra["stage_latency_f_s"],
                               out.extra["stage_latency_b_s"])
        p2p, post = costs.costs(schedule_lists)
    split = has_weight_actions(schedule_lists)
    return simulate(schedule_lists, fwd, bwd, p2p, wgt if split else None, post).idle_fraction


def step_record(trainer, step: int, out, dt: float | None, lr: float, syncs=None) -> dict:
    """Step ``step``'s (0-based) metrics record: tokens over the step's device time ``dt``, model
    and executed FLOPs over it per device, the bubble three ways, bytes per traffic kind, memory,
    the step's host waits (``syncs``: engine.device.syncs.SyncEvent list). ``dt`` None: the step's
    late keys (LATE_KEYS) are null, to be filled by ``LateRecords``."""
    cfg, world = trainer.cfg, trainer.ps.world_size
    tokens = cfg.data.global_batch_size * cfg.model.seq_length
    late = dt is None
    model_tflops = None if late else per_device(trainer.flops.model, dt, world)
    tflops = None if late else per_device(trainer.flops.executed, dt, world)
    return {"step": step + 1, "loss": out.loss, "lr": lr, "grad_norm": out.grad_norm,
            "loss_scale": out.loss_scale, "skipped": out.skipped, "tokens": tokens,
            "step_time_s": dt, "tokens_per_s": None if late else tokens / dt,
            "tflops_per_device": tflops, "model_tflops_per_device": model_tflops,
            "mfu": None if late else utilization(model_tflops, trainer.peak_tflops),
            "hfu": None if late else utilization(tflops, trainer.peak_tflops),
            "model_flops": trainer.flops.model, "executed_flops": trainer.flops.executed,
            **out.times,
            # TP collectives traced into a compiled graph are not seen by the comm layer
            "time_tp_exposed_s": None if cfg.compile else out.times.get("time_tp_exposed_s"),
            "bubble_theoretical": trainer.bubble_theory,
            "bubble_measured": out.extra.get("bubble_measured"),
            "bubble_simulated": simulated_bubble(getattr(trainer, "schedule_lists", None), out),
            "bubble_simulated_compute": simulated_bubble(getattr(trainer, "schedule_lists", None),
                                                         out, transfers=False),
            "time_pp_exposed_s": out.extra.get("time_pp_exposed_s"),
            "activations_in_flight": (out.pipeline.peak_in_flight
                                      if out.pipeline is not None else None),
            **comm_metrics(out.comm, cfg.compile,
                           balancing_all_reduce(cfg.model, trainer.ps.dp_cp_group.size)),
            **moe_record(out.extra.get("moe"), out.comm, cfg.compile),
            **{k: trainer.memory[k] for k in MEMORY_KEYS},
            "peak_memory_bytes": trainer.dev.peak_memory_bytes(),
            "host_syncs": None if syncs is None else len(syncs),
            "host_sync_points": None if syncs is None else [e.name for e in syncs]}


class LateRecords:
    """The trainer's records whose late keys wait for the next step's wait (see
    engine/training/late_figures.py): ``add`` after a step; ``complete()`` after the next one (or
    after ``Stepper.flush``) fills them in place; ``take()`` hands the whole ones over, in order."""

    def __init__(self, trainer):
        self.trainer, self.pending, self.done = trainer, [], []  # pending: (step, out, timer, lr, record)

    def add(self, step: int, out, timer, lr: float, record: dict) -> None:
        self.pending.append((step, out, timer, lr, record))

    def complete(self) -> None:
        """Fill the records whose step's figures are in (``out.complete``), in place."""
        while self.pending and self.pending[0][1].complete:
            step, out, timer, lr, record = self.pending.pop(0)
            full = step_record(self.trainer, step, out, timer.elapsed_s(), lr)
            record.update({k: full[k] for k in LATE_KEYS + PP_LATE_KEYS})
            self.done.append(record)

    def write(self, log, dash, records: list) -> None:
        """Hand the completed records to the metrics log, the dashboards and ``records``."""
        for record in self.take():
            log.log(record)
            dash.log(record)
            records.append(record)

    def take(self) -> list[dict]:
        """The records completed since the last ``take``, in step order."""
        self.complete()
        done, self.done = self.done, []
        return done


STRAGGLER_KEYS = ("straggler_rank", "straggler_ratio", "straggler_waited_for")


def anomaly_keys(trainer) -> dict:
    """The step's ``anomaly`` and ``rerun`` keys (null without the guard)."""
    return trainer.guard.record() if trainer.guard is not None else {"anomaly": None, "rerun": None}


def resilience_metrics(trainer, step: int, record: dict, log) -> None:
    """The step's anomaly keys and, every --log-interval steps, the straggler report (one
    all-gather, on every rank at the same steps), into ``record``; a console line only when a rank
    is slower than its peers past --straggler-threshold (engine/observe/stragglers.py)."""
    record.update(anomaly_keys(trainer))
    report = None
    if trainer.stragglers is not None:
        trainer.stragglers.end_step()
        if (step + 1) % trainer.cfg.log.log_interval == 0:
            report = trainer.stragglers.report(step + 1)
    record.update(report.metrics() if report is not None else dict.fromkeys(STRAGGLER_KEYS))
    _say_straggler(trainer, report, log)


def _say_straggler(trainer, report, log) -> None:
    if report is not None and report.found and trainer.is_main:  # a line only for a straggler
        log.note(f"gridtron: {report.describe(trainer.grid)}")


def final_straggler_report(trainer, records: list[dict], log) -> None:
    """After the last step: the intervals the run ends on, whose reports would land after it,
    read now (engine/observe/stragglers.py ``finish``: one wait, outside the steps); the line
    for a straggler, and the keys in the last record where it holds no other report. Called where
    that record is written: by a save at the run's end, before it publishes (run_events.py
    ``records_before_publish``), else after the loop (then, after a save, nothing is left)."""
    if trainer.stragglers is None:
        return
    report = trainer.stragglers.finish()
    if report is None:
        return
    if records and all(records[-1].get(k) is None for k in STRAGGLER_KEYS):
        records[-1].update(report.metrics())
    _say_straggler(trainer, report, log)


def describe_data(trainer) -> str:
    """What the run trained on: mock data, the --data-path prefixes (a blend as given) or the
    built-in corpus, with its training samples, split and vocabulary."""
    d, data = trainer.cfg.data, trainer.data
    if d.mock_data:
        return f"mock data, vocabulary {data.vocab_size}"
    source = (" ".join(map(str, d.data_path)) if d.data_path else
              f"built-in corpus {data.prefix} (--tokenizer {d.tokenizer})")
    return (f"{source}: {len(data.train):,} training samples (--split {d.split}), vocabulary "
            f"{data.vocab_size}")


TP_OVERLAP = {"ring": "chunked ring", "auto": "fused ops where the device has them, else chunked ring"}


def run_choices(trainer) -> list[str]:
    """Every choice that changes what runs, as the start line and the summary say them: the
    mixture of experts (experts, top-k, MoE layers, ep, etp), FP8 (format, recipe, the layers
    kept in bf16), the optimizer's ZeRO stage, the gradient compression and its warm-up, the TP
    overlap."""
    cfg, ps = trainer.cfg, trainer.ps
    m, par, p = cfg.model, cfg.parallel, cfg.precision
    out = []
    if m.num_experts is not None:
        layers = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
        where = "" if len(layers) == m.num_layers else f" on layers {layers}"
        out.append(f"MoE {m.num_experts} experts top-{m.moe_router_topk}{where}, ep "
                   f"{par.expert_model_parallel_size} etp {par.expert_tensor_parallel_size}")
    if p.fp8_format is not None:
        start, end = p.fp8_bf16_layers
        kept = [f"the first {start}"] * bool(start) + [f"the last {end}"] * bool(end)
        out.append(f"FP8 GEMMs {p.fp8_format} {p.fp8_recipe}" + (
            f" (bf16 in {' and '.join(kept)} layer{'s' if start + end > 1 else ''})" if kept else ""))
    out.append(f"ZeRO-{par.zero_stage} ({par.data_parallel_sharding_strategy})"
               if par.use_distributed_optimizer else "ZeRO-0 (optimizer state on every DP rank)")
    offload = getattr(trainer.optimizer, "offload", None)
    if offload is not None:
        out.append(f"optimizer state of {offload.fraction:.0%} of the shard in host memory")
    reducer = trainer.reducer
    if reducer.compressed:
        c, policy = cfg.compression, reducer.policy
        kind = "per --grad-compression-policy" if c.grad_compression_policy else c.grad_compression
        ratio = f" ratio {c.grad_compression_ratio:g}" if kind == "topk" else ""
        out.append(f"gradient compression {kind}{ratio} after {policy.warmup_steps} uncompressed "
                   f"step{'s' if policy.warmup_steps != 1 else ''}")
    else:
        out.append("no gradient compression")
    if ps.tp_size > 1:
        mode = getattr(trainer, "tp_overlap", None)
        out.append(f"TP overlap: {TP_OVERLAP.get(mode, mode)}" if mode else "no TP overlap")
    return out


def start_line(trainer) -> str:
    """The run's first line: layout, device, micro-batches, parameters and its choices."""
    return (f"gridtron: {trainer.grid.describe()} on {trainer.dev.type}; {trainer.num_micro} "
            f"micro-batches/step; {trainer.num_params_local:,} parameters on rank 0; "
            + "; ".join(run_choices(trainer)))


def duration_text(seconds: float) -> str:
    """A duration as a person reads it: 12 ms, 3.4 s, 12 min, 5.1 h, 3.2 days."""
    for limit, unit, div in ((1, "ms", 1e-3), (120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / div:.3g} {unit}"
    return f"{seconds / 86400:.3g} days"


def cost_line(trainer, steps: int) -> str:
    """What the run will cost before its first step: the step time at the device's peak (the
    executed FLOPs of a step, attention at this sequence length included, its core (Q K^T and
    scores x V) at half, the least a causal kernel runs: engine/plan/flops.py and
    engine/observe/utilization.py ``RunFlops.least``, over the devices' dense peak), a lower
    bound, and for the ``steps`` to run."""
    flops, peak, world = trainer.flops.least, trainer.peak_tflops, trainer.ps.world_size
    if flops is None or not peak:
        why = "no FLOPs count for the block" if flops is None else "no peak known for the device"
        return f"gridtron: the step time cannot be estimated ({why}; --peak-tflops gives one)"
    step = flops / (world * peak * 1e12)
    return (f"gridtron: estimated step time at least {duration_text(step)} ({flops:.3g} FLOPs "
            f"per step, causal attention at half, over {world} device{'s' if world > 1 else ''} "
            f"at {peak:.3g} TFLOP/s peak); "
            f"{steps} step{'s' if steps != 1 else ''}: at least {duration_text(step * steps)}")


def run_summary(trainer, result) -> str:
    """The closing summary table of ``result`` (a RunResult with records), with the run's facts:
    layout, its choices (``run_choices``), device, data, and where the metrics, timeline, plot,
    profile and checkpoint went."""
    cfg = trainer.cfg
    extra = {"layout": trainer.grid.describe(), "choices": "; ".join(run_choices(trainer)),
             "device": f"{trainer.dev.type} ({trainer.dev.name})", "data": describe_data(trainer)}
    if cfg.log.metrics_file:
        extra["metrics"] = cfg.log.metrics_file
    if cfg.log.timeline:
        extra["timeline"] = f"{cfg.log.timeline} (the last {TIMELINE_STEPS} steps)"
    if result.valid:
        extra["validation loss"] = f"{result.valid[0][1]:.4f} -> {result.valid[-1][1]:.4f}"
    if result.checkpoint:
        extra["checkpoint"] = result.checkpoint
    if result.stopped:
        extra["stopped"] = result.stopped
    if not trainer.flops.source.startswith("formula"):
        extra["FLOPs"] = trainer.flops.source
    if trainer.profiler.written:
        extra["profile"] = trainer.profiler.written
    if cfg.log.plot:
        extra["plot"] = plot_metrics(result.records, cfg.log.plot, result.valid)
    if trainer.peak_tflops:
        extra["peak (MFU, HFU)"] = (f"{trainer.peak_tflops:.4g} TFLOP/s per device "
                                    f"({trainer.peak_source})")
    if not (cfg.log.metrics_file or cfg.log.timeline or cfg.log.plot or result.checkpoint):
        extra["outputs"] = "none written (--run-dir DIR writes metrics, plots and checkpoints)"
    return summary_table(result.records, extra)
