"""The training job: build everything from a RunConfig, then loop over steps with metrics,
validation, checkpoints and a summary.

Setup order matters for errors: the whole configuration is validated (pure, identical on every
rank) before the process group exists, so a bad configuration never leaves a rank in a collective.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

from engine.base import ConfigError
from engine.config.digest import resolved_flags
from engine.config.schema import RunConfig
from engine.observe.dashboards import Dashboards
from engine.data.packing import MicroBatch
from engine.device.clock import DeviceClock, EventPair
from engine.device.chips import fp8_problem, npu_start_problem, tp_overlap_mode
from engine.device.runtime import set_matmul_precision, setup_device
from engine.training.dp_setup import build_optimizer, host_build
from engine.training.lr_schedule import learning_rate
from engine.training.model_checks import (check_after_first_steps, check_built_model,
                                           replica_check_step)
from engine.observe.anomaly import RunDiverged
from engine.observe.metrics import MetricsLog
from engine.observe.profiling import StepProfiler
from engine.training.step import Stepper
from engine.training.step_record import (TIMELINE_STEPS, LateRecords, anomaly_keys, cost_line,
                                         final_straggler_report, resilience_metrics, run_summary,
                                         start_line, step_record)
from engine.training.step_syncs import StepTimeline, counted_step
from engine.observe.utilization import run_flops, run_peak
from engine.plan.flops import routed_tokens
from engine.training.run_data import build_run_data, rank_batches, validation_loss
from engine.training.run_events import (install_stop_handlers, record_divergence,
                                        records_before_publish, restore_handlers, say_notes)
from engine.training.validate import validate_run
from kernels.fp8 import Fp8Recipe
from kernels.fp8_blockwise import blockwise_path
from models import LayerContext, build_chunks
from models.gpt import set_fp8_layers
from models.registry import BlockRegistry
from parallel.runtime.backend_rules import resolve as resolve_rules
from parallel.context_parallel import init_ring
from parallel.dp import CompressionPolicy, PolicyError
from parallel.expert_parallel import init_expert_groups
from parallel.pipeline.bubble import theoretical_bubble
from parallel.pipeline.partition import placement_stages, stage_layers
from parallel.pipeline.p2p import init_p2p, waiter_for
from parallel.pipeline.schedules import build_schedule, has_weight_actions, validate_schedule
from parallel.grid.random import ModelParallelRNG
from parallel.grid.launch import LaunchEnv
from parallel.tensor_parallel.layers import padded_vocab_size
from parallel.grid.state import ParallelState
from parallel.tensor_parallel import Initializer, set_tp_comm_overlap
from parallel.tensor_parallel.overlap_fused import probe_mode
from parallel.grads.weight_grad import WeightGradStore, attach_weight_grad_store
from engine.config.schema import PRECISION_DTYPES as DTYPES



class TrainingDiverged(RunDiverged):
    """A NaN/Inf loss in fp32 or bf16 (fp16 skips the step): the run stops and names the last
    good checkpoint."""


@dataclass
class RunResult:
    records: list[dict] = field(default_factory=list)
    valid: list[tuple[int, float]] = field(default_factory=list)
    summary: str = ""
    checkpoint: str | None = None
    stopped: str | None = None  # why the run ended before --train-iters (SIGTERM, SIGINT)
    interrupted: bool = False   # it was SIGINT (Ctrl-C): python -m engine.train exits 130


class Trainer:
    # updates applied so far: the learning-rate schedule's position, which a skipped step (an fp16
    # overflow, a non-finite gradient) does not advance, as in Megatron-LM and DeepSpeed
    schedule_step: int = 0

    def __init__(self, cfg: RunConfig, registry: BlockRegistry | None = None,
                 launch: LaunchEnv | None = None):
        self.cfg, self.registry = cfg, registry
        # the progress bar: where --progress is given, or by default on a terminal (a captured
        # log gets one console line per --log-interval instead of the bar's redraws)
        self.progress = cfg.log.progress and ("progress" in cfg.explicit or sys.stderr.isatty())
        self.launch = launch or LaunchEnv.from_env()
        self.grid, notes = validate_run(cfg, self.launch, registry)
        try:  # a bad per-branch compression policy fails here, before any collective
            compressed = CompressionPolicy.coerce(cfg.compression).any_compressed
        except PolicyError as exc:
            raise ConfigError(f"grad_compression_policy: {exc}") from exc
        self.dev = setup_device(cfg.device, self.launch.local_rank, self.launch.local_world_size)
        if cfg.parallel.distributed_backend != "auto":  # gloo with device tensors (validated)
            self.dev = dataclasses.replace(self.dev, backend=cfg.parallel.distributed_backend)
        problem = (npu_start_problem(self.dev.name, cfg.precision.precision, cfg.compile)
                   if self.dev.type == "npu" else None)
        if problem is None and cfg.precision.fp8_format is not None:
            problem = fp8_problem(self.dev.type, self.dev.name, self.dev.capability)
        if problem:  # a chip without bf16 or FP8, or --compile: before any process group exists
            raise ConfigError(problem)
        self.tf32 = set_matmul_precision(self.dev.type, cfg.precision.allow_tf32)
        rules = resolve_rules(cfg.parallel.backend_rules, self.dev.backend, self.dev.name)
        # every rank meets the others with its resolved flags before the first collective
        self.ps = ParallelState.initialize(self.grid, self.dev.device, self.dev.backend, self.launch,
                                           timeout_s=cfg.parallel.timeout_s, backend_rules=rules,
                                           agreement=resolved_flags(cfg), dp_exchange=compressed,
                                           say_notes=False)  # validate_run's notes hold them
        # mixture of experts: the EP and EDP groups, cut from the dp x cp ranks of each stage
        init_expert_groups(self.ps, cfg.parallel.expert_model_parallel_size, cfg.parallel.timeout_s,
                           cfg.parallel.expert_tensor_parallel_size, exchange=compressed)
        self.is_main = self.ps.rank == 0
        self.say_notes((*notes, *self.dev.notes))  # and the chip's fallbacks
        from parallel.runtime.heartbeat import Heartbeat
        self.heartbeat = Heartbeat.for_state(self.ps, cfg.parallel.timeout_s, self.dev.backend)
        self._build_data()
        self._build_model()
        self._build_step()

    def say_notes(self, notes) -> None:
        say_notes(self.is_main, notes)  # one plain line each, rank 0 (run_events.py)

    @classmethod
    def assemble(cls, cfg: RunConfig, ps: ParallelState, dev,
                 registry: BlockRegistry | None = None) -> "Trainer":
        """One rank's model chunks, reducer, optimizer and step on a ``ParallelState`` made
        elsewhere, by the same code as a run, without data, device setup, heartbeat or monitors:
        what ``engine.dryrun`` builds on the meta device under a fake process group (``dev``: an
        ``engine.device.runtime.DeviceInfo`` of that device)."""
        self = cls.__new__(cls)
        self.cfg, self.registry, self.ps, self.dev = cfg, registry, ps, dev
        self.grid, self.launch, self.is_main = ps.grid, None, ps.rank == 0
        self.progress = False
        self.num_micro = cfg.data.num_microbatches(ps.dp_size)
        self._build_model()
        self._build_optimizer()
        self._build_stepper()
        return self

    # ---- setup ----------------------------------------------------------------------------
    def _build_data(self) -> None:
        build_run_data(self)  # data, packing, sampler, num_micro, cp_index (run_data.py)

    def _build_model(self) -> None:
        cfg, ps = self.cfg, self.ps
        vp, placement = cfg.parallel.chunks_per_rank, cfg.parallel.placement  # zb-v: 2, "v"
        ranges = stage_layers(cfg.model.num_layers, ps.pp_size, vp, ps.pp_rank,
                              cfg.parallel.stage_end_weight, placement)
        virtual = placement_stages(ps.pp_size, vp, ps.pp_rank, placement)
        ctx = LayerContext(Initializer(cfg.seed, cfg.model.init_std),
                           sequence_parallel=cfg.parallel.sequence_parallel and ps.tp_size > 1,
                           recompute=cfg.parallel.recompute,
                           cp_comm_type=cfg.parallel.cp_comm_type, kernel_paths=self.dev.kernel_paths)
        # dropout streams (parallel/grid/random.py): per chunk, split regions per TP rank,
        # replicated regions the same on every TP rank, all distinct over pp, dp, cp and chunks
        self.rng = ModelParallelRNG.for_state(cfg.seed, ps, vp)
        self.rng.seed_default()
        ctxs = [dataclasses.replace(ctx, rng=tracker) for tracker in self.rng.trackers]
        self.dtype = DTYPES[cfg.precision.precision]
        # (ZeRO-3 on an accelerator: built in host memory, only the shards go to the device)
        device = None if host_build(cfg, self.dev.device) else self.dev.device
        self.chunks = build_chunks(cfg.model, ps, ctxs, ranges, virtual, ps.pp_size * vp,
                                   self.registry).to(device=device, dtype=self.dtype)
        p = cfg.precision
        self.fp8_layers = []  # global indices of this rank's layers with FP8 GEMMs
        if p.fp8_format is not None:  # FP8 GEMMs in the TP layers (docs/precision.md)
            self.fp8_layers = set_fp8_layers(self.chunks, Fp8Recipe(p.fp8_format, p.fp8_recipe),
                                             cfg.model.num_layers, *p.fp8_bf16_layers)
            if p.fp8_recipe == "blockwise":   # which kernel, probed once here (not in a step)
                say_notes(self.is_main, [blockwise_path(self.dev.type)])
        self.tp_overlap = None  # the TP overlap's mode, when on
        if cfg.parallel.tp_comm_overlap:  # chunked TP rings / fused ops (tensor_parallel/overlap.py)
            mode = tp_overlap_mode(self.dev.type, self.dev.name, ps.tp_size,
                                   cfg.parallel.sequence_parallel)
            mode, why = probe_mode(ps.tp_group, self.dev.device, mode)  # symmetric memory, once
            say_notes(self.is_main, [why] if why else [])
            set_tp_comm_overlap(self.chunks, mode)
            self.tp_overlap = mode
        check_built_model(self)  # CP's attention, the MoE layers, equal replicas: on every rank
        if cfg.compile:
            from engine.device.compile import compile_chunks
            self.chunks = compile_chunks(self.chunks, self.dev, cfg.log.compile_cache_root)
        self.num_params_local = sum(p.numel() for p in self.chunks.parameters())  # each once

    def _build_step(self) -> None:
        self._build_optimizer()
        self._build_stepper()
        self._build_monitors()

    def _build_optimizer(self) -> None:
        """Loss scaler, gradient reducer, optimizer and their exact memory (``self.memory``), by
        the data-parallel sharding strategy (dp_setup.py)."""
        build_optimizer(self)

    def _build_stepper(self) -> None:
        """The pipeline schedule, the p2p and ring communicators, the B/W split's store, the clock
        and the ``Stepper``."""
        cfg, ps = self.cfg, self.ps
        actions = act_shape = self.waiter = self.weight_grads = None
        self.timeline = StepTimeline(TIMELINE_STEPS)  # the last few steps, for --timeline
        self.late_records = LateRecords(self)  # records waiting for their late keys
        sp = cfg.parallel.sequence_parallel and ps.tp_size > 1
        if ps.pp_size > 1:
            vp = cfg.parallel.virtual_pipeline_size
            self.schedule_lists = build_schedule(cfg.parallel.pipeline_schedule, ps.pp_size,
                                                 self.num_micro, vp)
            validate_schedule(self.schedule_lists)
            actions = self.schedule_lists[ps.pp_rank]
            s = cfg.model.seq_length // ps.cp_size // (ps.tp_size if sp else 1)
            act_shape = (cfg.data.micro_batch_size, s, cfg.model.hidden_size)
            init_p2p(ps)
            self.waiter = waiter_for(self.dev.backend)
            if has_weight_actions(self.schedule_lists):
                # the B/W split: the layers queue weight gradients in B, the schedule's W runs
                # them into main_grad and tells the reducer (parallel/grads/weight_grad.py)
                self.weight_grads = WeightGradStore(on_ready=self.reducer.grad_accumulated)
                self.reducer.split_weight_grads(self.weight_grads)
                attach_weight_grad_store(list(self.chunks), self.weight_grads)
        init_ring(ps)
        self.clock = DeviceClock(self.dev.type)
        self.stepper = Stepper(ps, self.chunks, self.reducer, self.optimizer, self.scaler,
                               cfg.optim.clip_grad, actions, act_shape, self.dtype,
                               cfg.parallel.timeout_s, self.dev.overflow_check(), self.waiter,
                               clock=self.clock, placement=cfg.parallel.placement,
                               weight_grads=self.weight_grads,
                               scatter_gather=cfg.parallel.scatter_gather_tensors_in_pipeline
                               and not sp,
                               schedule_lists=self.schedule_lists if ps.pp_size > 1 and
                               self._one_clock(ps.pp_group.ranks) else None)

    def _one_clock(self, ranks) -> bool:
        """Whether ``ranks`` share one host's clock: the pipeline's exposed transfer time compares
        a peer's post times with this rank's waits (parallel/pipeline/transfers.py), a figure
        that cannot be known across hosts (it is null there)."""
        return self.launch is None or self.launch.one_host(ranks)

    def _build_monitors(self) -> None:
        """FLOPs and peak for MFU, the profiler, the anomaly guard, stragglers, the bubble."""
        cfg, ps = self.cfg, self.ps
        with warnings.catch_warnings(record=True) as caught:  # a block without a formula
            warnings.simplefilter("always")
            par = cfg.parallel
            routed = routed_tokens(cfg.data.micro_batch_size, cfg.model.seq_length, ps.cp_size,
                                   ps.tp_size, par.sequence_parallel, par.expert_tensor_parallel_size)
            self.flops = run_flops(cfg.model, self.chunks[0].block_cls, par.recompute,
                                   cfg.data.global_batch_size, routed,
                                   padded_vocab_size(cfg.model.vocab_size, ps.tp_size))
        self.say_notes([str(w.message) for w in caught])
        self.peak_tflops, self.peak_source = run_peak(self.dev, cfg.precision.precision,
                                                      cfg.log.peak_tflops, self.tf32)
        self.profiler = StepProfiler.from_config(cfg.log, self.dev.type, ps.rank)
        from engine.observe.anomaly import AnomalyGuard
        from engine.observe.stragglers import StragglerMonitor, peer_roles
        self.guard = AnomalyGuard.for_trainer(self)  # None without --rerun-on-anomaly/--spike-factor
        # the step's device clock (events on CUDA/NPU, perf_counter on CPU); ranks compare with
        # the peers of their pipeline stages only
        self.stragglers = (StragglerMonitor(ps, self.clock,
                                            peer_roles(self.grid, cfg.parallel.chunks_per_rank,
                                                       cfg.parallel.placement),
                                            cfg.log.straggler_threshold)
                           if cfg.log.log_straggler and ps.world_size > 1 else None)
        self.bubble_theory = (theoretical_bubble(cfg.parallel.pipeline_schedule, ps.pp_size,
                                                 self.num_micro, cfg.parallel.virtual_pipeline_size)
                              if ps.pp_size > 1 else None)

    # ---- data -----------------------------------------------------------------------------
    def _batches(self, step: int, dataset=None, sampler=None) -> list[MicroBatch]:
        """This rank's micro-batches of ``step`` (run_data.py ``rank_batches``)."""
        return rank_batches(self, step, dataset, sampler)

    # ---- loop -----------------------------------------------------------------------------
    def train(self) -> RunResult:
        cfg, ps = self.cfg, self.ps
        result = RunResult()
        start = self.maybe_load()
        log = MetricsLog(cfg.log.metrics_file if self.is_main else None, enabled=self.is_main,
                         progress=self.progress, total_steps=cfg.optim.train_iters,
                         log_interval=cfg.log.log_interval)
        log.start_at(start)
        dash = Dashboards(cfg, self.is_main, start)
        self._outputs = (log, dash, result.records)  # where before_publish writes records
        if self.is_main:  # what runs, and what it will cost, before the first step
            log.note(start_line(self))
            log.note(cost_line(self, cfg.optim.train_iters - start))
        from engine.checkpoint.async_writer import Checkpointer
        self.checkpointer = Checkpointer(self)
        # the checkpointer's stop/save counters ride on each step's statistics all-reduce
        self.stepper.agreement.set("checkpoint", 4, self.checkpointer.counts)
        previous_handlers = install_stop_handlers(self)  # SIGTERM, SIGINT (run_events.py)
        check_at = replica_check_step(self, start)  # (model_checks.py)
        try:
            for step in range(start, cfg.optim.train_iters):
                if self.stragglers is not None:
                    self.stragglers.begin_step(step + 1)
                record = self.train_one(step)
                record["warmup"] = step == start  # this process's first step (--calibrate skips it)
                if step == check_at:  # the first updates kept every replica equal
                    check_after_first_steps(self, step)
                self.late_records.write(log, dash, result.records)  # the previous step's, complete
                resilience_metrics(self, step, record, log)
                if cfg.log.eval_interval and (step + 1) % cfg.log.eval_interval == 0:
                    vloss = self.evaluate()
                    record["valid_loss"] = vloss
                    result.valid.append((step + 1, vloss))
                    if self.progress:
                        log.note(f"step {step + 1}: validation loss {vloss:.4f}")
                interval = cfg.checkpoint.save_interval
                b = self.checkpointer.boundary(step + 1, bool(interval) and (step + 1) % interval == 0,
                                               self.stop_signal is not None,
                                               last=step + 1 == cfg.optim.train_iters,
                                               agreed=self.stepper.agreed.get("checkpoint"))
                # (a record written before its own save's publication keeps the time up to it)
                record.setdefault("save_blocking_s", b.blocking_s)
                result.checkpoint = b.published or result.checkpoint
                if b.stop:  # SIGTERM or SIGINT on some rank: every rank stops after this step
                    result.stopped = f"stopped by {b.by} after step {step + 1}"
                    result.interrupted = b.by == "SIGINT"
                    log.note(f"gridtron: {result.stopped} (of {cfg.optim.train_iters})"
                             + (f"; saved {b.published}" if b.published else ""))
                    break
            self.flush()  # the last step's late figures (one wait, after the steps)
            final_straggler_report(self, self.late_records.done, log)   # (the last record's)
            self.late_records.write(log, dash, result.records)
            if cfg.checkpoint.save and not result.records:
                result.checkpoint = self.save(cfg.optim.train_iters)
            self.params_ready()  # the last step's parameter all-gathers
        except RunDiverged as exc:  # on every rank, from the same sums: collectives are safe
            record_divergence(self, exc, step, first=step == start)
            raise
        finally:
            self._outputs = None
            log.close()
            dash.close()
            self.profiler.close()
            restore_handlers(previous_handlers)
        if self.is_main and result.records:
            result.summary = run_summary(self, result)
        if cfg.log.timeline:
            self.timeline.write(ps, self.grid, cfg.log.timeline)
        return result

    def train_one(self, step: int) -> dict:
        """Step ``step`` (0-based). Its record's late keys (LATE_KEYS: the step's time and what
        follows from it, the update's span, the bubble) are null until the next step's wait fills
        them in place (or ``stepper.flush`` after the last): nothing waits for the device before
        the forward, and the step waits once (engine/device/syncs.py, counted in ``host_syncs``)."""
        cfg = self.cfg
        self.dev.reset_peak_memory()
        self.profiler.before_step(step + 1)
        timer = EventPair(self.clock).start()  # read at the next step's wait
        batches = self._batches(step)  # host tensors, then queued copies: not the step's waits
        lr = learning_rate(self.schedule_step, cfg.optim)
        self.stepper.current_step = step + 1  # names the step in anomaly reports
        out, events = counted_step(self, batches, lr, timer, step + 1)
        self.schedule_step += not out.skipped   # (decided on the host at the step's one wait)
        self.profiler.after_step(step + 1)
        self.sampler.next_step = step + 1
        if not math.isfinite(out.loss) and cfg.precision.precision != "fp16":
            record = {**step_record(self, step, out, None, lr, events), **anomaly_keys(self)}
            raise TrainingDiverged(f"loss is {out.loss} at step {step + 1}",
                                   self.last_checkpoint(), record)
        if cfg.log.timeline:  # converted at the end: converting stamps now would wait
            self.timeline.add(step + 1, out, events)
        record = step_record(self, step, out, None, lr, events)
        self.late_records.add(step, out, timer, lr, record)
        return record

    def flush(self) -> None:
        """Fill the late keys of the records ``train_one`` returned so far (the last one's after
        one more wait; with a pipeline a collective: every rank calls it)."""
        self.stepper.flush()
        self.late_records.complete()

    def before_publish(self, step: int, blocking_s: float | None, ending: bool = False) -> None:
        """Before checkpoint ``step`` becomes ``latest`` (engine/checkpoint/writer.py, every
        rank): the records of steps 1..step written and fsynced (run_events.py)."""
        outputs = getattr(self, "_outputs", None)
        if outputs is not None:  # (None: a save outside train())
            records_before_publish(self, outputs, step, blocking_s, ending)

    def params_ready(self) -> None:
        """Wait for ZeRO's parameter all-gathers still in flight (overlapped with the next forward
        otherwise): whatever reads the parameters outside a training forward calls this first."""
        finish = getattr(self.optimizer, "finish_param_gather", None)
        if finish is not None:
            finish()

    def evaluate(self) -> float:
        """Mean validation loss over ``eval_iters`` global batches (run_data.py)."""
        return validation_loss(self)

    # ---- checkpoints ----------------------------------------------------------------------
    def save(self, step: int) -> str:
        from engine.checkpoint import save_checkpoint
        return save_checkpoint(self, step)

    def maybe_load(self) -> int:
        """The step to start from: --load, or an unfinished run's checkpoint in --save
        (engine/checkpoint/resume.py)."""
        from engine.checkpoint.resume import resume
        return resume(self)

    def last_checkpoint(self) -> str | None:
        root = self.cfg.checkpoint.save
        latest = os.path.join(root, "latest") if root else None
        if latest and os.path.exists(latest):
            return os.path.realpath(latest)
        return getattr(self, "loaded_checkpoint", None)

    def close(self) -> None:
        self.params_ready()
        self.reducer.remove_hooks()
        if self.waiter is not None and hasattr(self.waiter, "watchdog"):
            self.waiter.watchdog.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.ps.destroy()
