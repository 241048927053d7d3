"""The training job: build everything from a RunConfig, then loop over steps with metrics,
validation, checkpoints and a summary.

Setup order matters for errors: the whole configuration is validated (pure, identical on every
rank) before the process group exists, so a bad configuration never leaves a rank in a collective.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from engine.cli import ConfigError
from engine.config import RunConfig
from engine.data import GlobalBatchSampler, build_data, collate
from engine.data.packing import MicroBatch, count_loss_tokens, micro_batch
from engine.device import measure_cpu_peak_tflops, setup_device
from engine.plan.flops import model_flops_per_step
from engine.plan.hardware import lookup_peak_tflops
from engine.loss_scaler import ConstantScaler, DynamicLossScaler
from engine.lr_schedule import learning_rate
from engine.metrics import MetricsLog, plot_metrics, summary_table
from engine.step import Stepper
from engine.validate import validate_packing, validate_run
from models import LayerContext, build_chunks
from models.registry import BlockRegistry
from parallel.backend_rules import resolve as resolve_rules
from parallel.dp import (CompressionPolicy, DistributedOptimizer, GradReducer,
                         MixedPrecisionOptimizer, PolicyError, memory_bytes)
from parallel.pipeline.bubble import simulate, theoretical_bubble
from parallel.pipeline.timeline import TimelineEvent, gather_events, write_chrome_trace
from parallel.pipeline.partition import stage_layers
from parallel.pipeline.p2p import init_p2p
from parallel.pipeline.schedules import build_schedule, validate_schedule
from parallel.state import LaunchEnv, ParallelState
from parallel.tensor_parallel import Initializer

TIMELINE_STEPS = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def comm_metrics(comm: dict, compiled: bool = False) -> dict:
    """The step's bytes per traffic kind: payload handed to collectives (``*_comm_bytes``) and, for
    DP, the ring-model bytes on the wire. DP is the gradient/parameter group (DP x CP with context
    parallelism); PP counts the activations and gradients this rank sends to its neighbours. TP and
    CP collectives inside compiled chunks are not counted (parallel/comm.py): null then."""
    def total(kinds, key):
        return sum(comm[k][key] for k in kinds)
    return {"dp_comm_bytes": total(("dp", "dp_cp"), "payload_bytes"),
            "dp_comm_wire_bytes": total(("dp", "dp_cp"), "wire_bytes"),
            "tp_comm_bytes": None if compiled else total(("tp",), "payload_bytes"),
            "cp_comm_bytes": None if compiled else total(("cp",), "payload_bytes"),
            "pp_comm_bytes": total(("pp",), "payload_bytes")}


class TrainingDiverged(RuntimeError):
    """A NaN/Inf loss in fp32: the run stops and names the last good checkpoint."""


@dataclass
class RunResult:
    records: list[dict] = field(default_factory=list)
    valid: list[tuple[int, float]] = field(default_factory=list)
    summary: str = ""
    checkpoint: str | None = None


class Trainer:
    def __init__(self, cfg: RunConfig, registry: BlockRegistry | None = None,
                 launch: LaunchEnv | None = None):
        self.cfg, self.registry = cfg, registry
        self.launch = launch or LaunchEnv.from_env()
        self.grid, notes = validate_run(cfg, self.launch, registry)
        try:  # a bad per-branch compression policy fails here, before any collective
            CompressionPolicy.coerce(cfg.compression)
        except PolicyError as exc:
            raise ConfigError(f"grad_compression_policy: {exc}") from exc
        self.dev = setup_device(cfg.device, self.launch.local_rank)
        rules = resolve_rules(cfg.parallel.backend_rules, self.dev.backend, self.dev.name)
        self.ps = ParallelState.initialize(self.grid, self.dev.device, self.dev.backend, self.launch,
                                           timeout_s=cfg.parallel.timeout_s, backend_rules=rules)
        self.is_main = self.ps.rank == 0
        for note in notes:
            if self.is_main:
                warnings.warn(note)
        self._build_data()
        self._build_model()
        self._build_step()

    # ---- setup ----------------------------------------------------------------------------
    def _build_data(self) -> None:
        cfg, ps = self.cfg, self.ps
        def build():
            try:
                return build_data(cfg.data.data_path, cfg.model.seq_length, cfg.seed,
                                  mock=cfg.data.mock_data,
                                  vocab_size=cfg.model.vocab_size if cfg.data.mock_data else None,
                                  tokenizer=cfg.data.tokenizer, cache_dir=cfg.data.cache_dir,
                                  valid_fraction=cfg.data.valid_fraction)
            except (ValueError, FileNotFoundError) as exc:  # e.g. a corpus too small for --seq-length
                raise ConfigError(f"data: {exc}") from exc

        if ps.world_size > 1 and not cfg.data.mock_data and cfg.data.data_path is None:
            # rank 0 prepares and caches the built-in corpus once; its outcome reaches every rank,
            # so a failure there ends all ranks with the same message instead of a hang
            outcome = None
            if ps.rank == 0:
                try:
                    self.data = build()
                except ConfigError as exc:
                    outcome = str(exc)
            outcome = ps.world_group.broadcast_object(outcome, src=0)
            if outcome is not None:
                raise ConfigError(outcome)
            if ps.rank != 0:
                self.data = build()
        else:
            self.data = build()
        self.cfg.model.vocab_size = self.data.vocab_size
        self.packing = validate_packing(cfg, getattr(self.data.train, "eot_id", None))
        self.sampler = GlobalBatchSampler(len(self.data.train), cfg.data.global_batch_size, cfg.seed)
        self.num_micro = cfg.data.num_microbatches(ps.dp_size)

    def _build_model(self) -> None:
        cfg, ps = self.cfg, self.ps
        vp = cfg.parallel.virtual_pipeline_size
        ranges = stage_layers(cfg.model.num_layers, ps.pp_size, vp, ps.pp_rank,
                              cfg.parallel.stage_end_weight)
        virtual = [c * ps.pp_size + ps.pp_rank for c in range(vp)]
        ctx = LayerContext(Initializer(cfg.seed, cfg.model.init_std),
                           sequence_parallel=cfg.parallel.sequence_parallel and ps.tp_size > 1,
                           recompute=cfg.parallel.recompute)
        self.dtype = DTYPES[cfg.precision.precision]
        self.chunks = build_chunks(cfg.model, ps, ctx, ranges, virtual, ps.pp_size * vp,
                                   self.registry).to(device=self.dev.device, dtype=self.dtype)
        # dropout streams: identical across TP ranks (replicated regions), distinct across DP/PP
        tp_part = ps.tp_rank if ctx.sequence_parallel else 0
        torch.manual_seed(cfg.seed + 1 + 1000 * ps.dp_rank + 100 * ps.pp_rank + 10 * tp_part)
        if cfg.compile:
            from engine.compile import compile_chunks
            self.chunks = compile_chunks(self.chunks, self.dev, cfg.log.run_dir)
        params = [p for c in self.chunks for p in c.parameters()]
        self.num_params_local = sum(p.numel() for p in params)

    def _build_step(self) -> None:
        cfg, ps = self.cfg, self.ps
        p = cfg.precision
        self.scaler = (DynamicLossScaler(p.initial_loss_scale, 2.0, 0.5, p.loss_scale_window,
                                         p.hysteresis, p.min_loss_scale)
                       if p.precision == "fp16" else ConstantScaler(1.0))
        named = [(n, q) for c in self.chunks for n, q in c.logical_named_parameters()]
        self.reducer = GradReducer(named, ps, bucket_size_mb=cfg.parallel.bucket_size_mb,
                                   compression_policy=cfg.compression,
                                   overlap=cfg.parallel.overlap_grad_reduce)
        self.reducer.loss_scaler = self.scaler   # top-k's local variance statistics, unscaled
        o = cfg.optim
        groups = [{"params": [q for n, q in named if q.ndim >= 2 and "position" not in n],
                   "weight_decay": o.weight_decay},
                  {"params": [q for n, q in named if q.ndim < 2 or "position" in n],
                   "weight_decay": 0.0}]  # no decay on biases, norms and position tables
        adam = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                    weight_decay=o.weight_decay)
        if cfg.parallel.use_distributed_optimizer:
            # under --compile the chunks' forward pre-hooks would be traced: gather synchronously
            overlap = cfg.parallel.overlap_param_gather and not cfg.compile
            self.optimizer = DistributedOptimizer(groups, self.reducer, ps, zero_stage=cfg.parallel.zero_stage,
                                                  overlap_param_gather=overlap, **adam)
            self.optimizer.register_param_gather_hooks(self.chunks)
        else:
            self.optimizer = MixedPrecisionOptimizer(groups, self.reducer, ps, **adam)
        # exact bytes each of this rank's parameters, gradients and optimizer state hold
        self.memory = memory_bytes(self.reducer, self.optimizer)
        actions = act_shape = None
        self.timeline: list = []  # events of the last few steps, for --timeline
        if ps.pp_size > 1:
            vp = cfg.parallel.virtual_pipeline_size
            self.schedule_lists = build_schedule(cfg.parallel.pipeline_schedule, ps.pp_size,
                                                 self.num_micro, vp)
            validate_schedule(self.schedule_lists)
            actions = self.schedule_lists[ps.pp_rank]
            s = cfg.model.seq_length // (ps.tp_size if cfg.parallel.sequence_parallel else 1)
            act_shape = (cfg.data.micro_batch_size, s, cfg.model.hidden_size)
            init_p2p(ps)
        self.stepper = Stepper(ps, self.chunks, self.reducer, self.optimizer, self.scaler,
                               cfg.optim.clip_grad, actions, act_shape, self.dtype,
                               cfg.parallel.timeout_s)
        m = cfg.model
        self.flops_per_step = model_flops_per_step(
            cfg.data.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size,
            ffn_hidden=m.ffn_hidden_size, kv_hidden=m.kv_hidden_size,
            block="llama" if getattr(self.chunks[0].block_cls, "mlp_kind", "gelu") == "swiglu" else "gpt2",
            recompute=cfg.parallel.recompute)
        peak = cfg.log.peak_tflops or lookup_peak_tflops(self.dev.name)
        if peak is None and self.dev.type == "cpu":
            peak = measure_cpu_peak_tflops()
        self.peak_tflops = peak
        self.bubble_theory = (theoretical_bubble(cfg.parallel.pipeline_schedule, ps.pp_size,
                                                 self.num_micro, cfg.parallel.virtual_pipeline_size)
                              if ps.pp_size > 1 else None)

    # ---- data -----------------------------------------------------------------------------
    def _batches(self, step: int, dataset=None, sampler=None) -> list[MicroBatch]:
        """This rank's micro-batches of ``step`` (``MicroBatch``: tokens, labels and, with packed
        documents, the per-token metadata every stage builds alike from the same tokens)."""
        sampler = sampler or self.sampler
        ds = dataset or self.data.train
        micro = sampler.micro_batches(step, self.ps.dp_rank, self.ps.dp_size,
                                      self.cfg.data.micro_batch_size)
        pack, loss_tokens = self.packing, None
        if pack is not None and pack.eod_mask_loss and self.ps.is_last_stage:
            # the mean is over the unmasked tokens of the whole global batch, whatever the layout
            loss_tokens = count_loss_tokens(ds, sampler.global_batch(step), pack.eod_id)
        return [micro_batch(collate(ds, idx), pack, loss_tokens).to(self.dev.device)  # (b, s) each
                for idx in micro]

    # ---- loop -----------------------------------------------------------------------------
    def train(self) -> RunResult:
        cfg, ps = self.cfg, self.ps
        result = RunResult()
        start = self.maybe_load()
        log = MetricsLog(cfg.log.metrics_file if self.is_main else None, enabled=self.is_main,
                         progress=cfg.log.progress, total_steps=cfg.optim.train_iters)
        log.start_at(start)
        if self.is_main:
            log.note(f"gridtron: {self.grid.describe()} on {self.dev.type}; {self.num_micro} "
                     f"micro-batches/step; {self.num_params_local:,} parameters on rank 0")
        try:
            for step in range(start, cfg.optim.train_iters):
                record = self.train_one(step)
                log.log(record)
                result.records.append(record)
                if cfg.log.eval_interval and (step + 1) % cfg.log.eval_interval == 0:
                    vloss = self.evaluate()
                    result.valid.append((step + 1, vloss))
                    log.note(f"step {step + 1}: validation loss {vloss:.4f}")
                if cfg.checkpoint.save and cfg.checkpoint.save_interval and \
                        (step + 1) % cfg.checkpoint.save_interval == 0:
                    result.checkpoint = self.save(step + 1)
            if cfg.checkpoint.save and (not result.records or result.checkpoint is None or
                                        not result.checkpoint.endswith(f"{cfg.optim.train_iters:07d}")):
                result.checkpoint = self.save(cfg.optim.train_iters)
            self.params_ready()  # the last step's parameter all-gathers
        finally:
            log.close()
        if self.is_main and result.records:
            extra = {"layout": self.grid.describe(), "device": f"{self.dev.type} ({self.dev.name})"}
            if result.valid:
                extra["validation loss"] = f"{result.valid[0][1]:.4f} -> {result.valid[-1][1]:.4f}"
            if result.checkpoint:
                extra["checkpoint"] = result.checkpoint
            if cfg.log.plot:
                extra["plot"] = plot_metrics(result.records, cfg.log.plot, result.valid)
            result.summary = summary_table(result.records, extra)
        if cfg.log.timeline:
            gathered = gather_events(ps, self.timeline_events)
            if self.is_main:
                labels = {r: f"rank {r} (tp {c.tp}, pp {c.pp}, dp {c.dp})"
                          for r in range(ps.world_size) for c in [self.grid.coord(r)]}
                write_chrome_trace(cfg.log.timeline, gathered, labels)
        return result

    def train_one(self, step: int) -> dict:
        cfg, ps = self.cfg, self.ps
        self.dev.reset_peak_memory()
        self.dev.synchronize()
        t0 = time.perf_counter()
        batches = self._batches(step)
        lr = learning_rate(step, cfg.optim)
        out = self.stepper.run(batches, lr)
        self.dev.synchronize()
        dt = time.perf_counter() - t0
        self.sampler.next_step = step + 1
        if not math.isfinite(out.loss) and cfg.precision.precision != "fp16":
            last = self.last_checkpoint()
            raise TrainingDiverged(f"loss is {out.loss} at step {step + 1}; last good checkpoint: "
                                   f"{last or 'none saved'}")
        tokens = cfg.data.global_batch_size * cfg.model.seq_length
        tflops = self.flops_per_step / dt / ps.world_size / 1e12
        if cfg.log.timeline:
            self._record_timeline(step, t0, dt, out)
        return {"step": step + 1, "loss": out.loss, "lr": lr, "grad_norm": out.grad_norm,
                "loss_scale": out.loss_scale, "skipped": out.skipped, "tokens": tokens,
                "step_time_s": dt, "tokens_per_s": tokens / dt, "tflops_per_device": tflops,
                "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
                "bubble_theoretical": self.bubble_theory,
                "bubble_measured": out.extra.get("bubble_measured"),
                "bubble_simulated": self._simulated_bubble(out),
                "activations_in_flight": (out.pipeline.peak_in_flight
                                          if out.pipeline is not None else None),
                **comm_metrics(out.comm, cfg.compile),
                **{k: self.memory[k] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes")},
                "peak_memory_bytes": self.dev.peak_memory_bytes()}

    def _simulated_bubble(self, out) -> float | None:
        """The schedule replayed with this step's measured mean forward/backward time per stage:
        what the bubble would be from stage imbalance alone, without communication or noise."""
        if out.pipeline is None:
            return None
        fwd, bwd = out.extra["stage_fwd_s"], out.extra["stage_bwd_s"]
        if min(fwd) <= 0 or min(bwd) <= 0:
            return None
        return simulate(self.schedule_lists, fwd, bwd).idle_fraction

    def _record_timeline(self, step: int, t0: float, dt: float, out) -> None:
        """Keep the events of the last TIMELINE_STEPS steps: the executor's forward, backward and
        transfer spans, plus one span for the optimizer part of the step."""
        events = list(out.pipeline.events) if out.pipeline is not None else []
        offset = time.time() - time.perf_counter()
        end = t0 + dt + offset
        opt_start = max(e.end for e in events) if events else t0 + offset
        events.append(TimelineEvent(self.ps.rank, f"optimizer (step {step + 1})", "optimizer",
                                    opt_start, end))
        self.timeline.append(events)
        del self.timeline[:-TIMELINE_STEPS]

    @property
    def timeline_events(self) -> list:
        return [e for step in self.timeline for e in step]

    def params_ready(self) -> None:
        """Wait for ZeRO's parameter all-gathers still in flight (overlapped with the next forward
        otherwise): whatever reads the parameters outside a training forward calls this first."""
        finish = getattr(self.optimizer, "finish_param_gather", None)
        if finish is not None:
            finish()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_iters`` global batches of the validation split."""
        cfg = self.cfg
        self.params_ready()
        sampler = GlobalBatchSampler(len(self.data.valid), cfg.data.global_batch_size, cfg.seed)
        for c in self.chunks:
            c.eval()
        total = 0.0
        for it in range(cfg.log.eval_iters):
            total += self.stepper.forward_only(self._batches(it, self.data.valid, sampler))
        for c in self.chunks:
            c.train()
        return total / cfg.log.eval_iters

    # ---- checkpoints ----------------------------------------------------------------------
    def save(self, step: int) -> str:
        from engine.checkpoint import save_checkpoint
        self.params_ready()
        return save_checkpoint(self, step)

    def maybe_load(self) -> int:
        """Load --load; without it, resume from --save when that holds an unfinished run's
        checkpoint (so a job restarted by torchrun continues by itself)."""
        from engine.checkpoint import has_checkpoint, load_checkpoint, saved_step
        ck = self.cfg.checkpoint
        fresh = ck.load and ck.save and os.path.realpath(ck.load) == os.path.realpath(ck.save) \
            and not has_checkpoint(ck.save)
        if ck.load and not fresh:  # (--load DIR --save DIR on a first run starts from scratch)
            return load_checkpoint(self, ck.load)
        if has_checkpoint(ck.save):
            step = saved_step(ck.save)
            if step is None or step < self.cfg.optim.train_iters:
                if self.is_main:
                    print(f"gridtron: resuming from {ck.save} (step {step}); pass --load to choose "
                          f"another checkpoint", flush=True)
                return load_checkpoint(self, ck.save)
            if self.is_main:
                warnings.warn(f"{ck.save} already holds a finished run (step {step} >= --train-iters "
                              f"{self.cfg.optim.train_iters}): starting a new run that will replace "
                              f"its checkpoints; pass --load {ck.save} to continue from it instead")
        return 0

    def last_checkpoint(self) -> str | None:
        root = self.cfg.checkpoint.save
        latest = os.path.join(root, "latest") if root else None
        if latest and os.path.exists(latest):
            return os.path.realpath(latest)
        return getattr(self, "loaded_checkpoint", None)

    def close(self) -> None:
        self.params_ready()
        self.reducer.remove_hooks()
        self.ps.destroy()
