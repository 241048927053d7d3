"""Bad steps, attributed: a non-finite or spiking loss or gradient norm is caught before the update,
the step is run again once from its saved inputs (``--rerun-on-anomaly``), and the run says whether
the fault repeated and where it came from.

Detection, on every step, with no collective or host read of its own:

- the global gradient norm and the global-batch loss come out of the step's statistics all-reduce
  (engine/training/step.py), the same numbers on every rank: each rank judges the norm non-finite (fp32 and
  bf16; under fp16 an overflow is the loss scaler's business) or above ``--spike-factor`` times the
  median of the last ``--spike-window`` accepted norms, and the loss the same way (non-finite
  outside fp16; a spike over the loss median).

So every rank takes the same decision from the same sums, before the optimizer step.

Evidence (with ``--rerun-on-anomaly``; device work only, read on an anomaly): each DP bucket, as it
is launched and before the reduction mixes the replicas (the reducer's ``pre_reduce_hooks``), gets
one multi-tensor norm of its parameters' local gradients, so a non-finite gradient is pinned to the
rank that produced it and to a parameter by logical name; the micro-batch losses of the step are
kept. The re-run also checks every parameter's gradient of every micro-batch (tensor hooks), which
names the micro-batch when the fault repeats.

On an anomaly (the slow path), every rank packs its findings into a fixed-width int32 vector
(verdicts, count of non-finite parameters, micro-batches, the first parameter's name as character
codes) and one all-gather gives every rank all of them. The step's inputs saved before it ran are
put back: the loss scaler's state, the reducer's step counter and compression residuals (with 1-bit
Adam's or DGC's momentum, and under ZeRO its seed shard not yet gathered), and the random states
(the micro-batches are kept; parameters and optimizer state were never changed). The step runs
again and is judged again:

- not anomalous: the fault was transient (hardware, or a one-off): the clean re-run is the step
  that is applied, so the run continues exactly as a run without the fault;
- anomalous again: persistent (the data or the model). A non-finite one stops the run on every rank
  (``PersistentAnomaly``), naming the step, rank, micro-batch and parameter and the last good
  checkpoint (the trainer first writes the records and publishes a save in flight); a reproducible
  spike is applied (it is what the data says) and reported.

Without ``--rerun-on-anomaly`` a spike is only reported, and a non-finite step does what it did
before: it is skipped (gradient) or the run stops (loss).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

NAME_CHARS = 120                  # a parameter name travels as this many character codes
HEAD = 6                          # [norm non-finite, norm spike, bad params, loss micro, grad micro, name length]
WIDTH = HEAD + NAME_CHARS


class RunDiverged(RuntimeError):
    """A fault that stops the run, raised by every rank from the same all-reduced numbers:
    ``why``, then the last good checkpoint (``name_checkpoint``: the trainer names it again once a
    save in flight is published); ``record``: the failing step's metrics keys."""

    def __init__(self, why: str, checkpoint: str | None = None, record: dict | None = None):
        super().__init__()
        self.why, self.checkpoint, self.record = why, checkpoint, record or {}
        self.name_checkpoint(checkpoint)

    def name_checkpoint(self, checkpoint: str | None) -> None:
        self.checkpoint = checkpoint
        self.args = (f"{self.why}; last good checkpoint: {checkpoint or 'none saved'}",)

    def __reduce__(self):
        return type(self), (self.why, self.checkpoint, self.record)


class PersistentAnomaly(RunDiverged):
    """A non-finite step that repeated when run again: every rank stops together."""


class SpikeDetector:
    """``value > factor x`` the median of the last ``window`` accepted values (once ``min_history``
    are known). Pure; ``factor <= 0`` never flags. Example: factor 5, history [2.0, 2.2, 2.1]:
    median 2.1, so 10.6 is a spike and 10.4 is not."""

    def __init__(self, factor: float, window: int = 32, min_history: int = 3):
        self.factor, self.min_history = factor, min_history
        self.history: deque[float] = deque(maxlen=window)

    def threshold(self) -> float | None:
        if self.factor <= 0 or len(self.history) < self.min_history:
            return None
        return self.factor * statistics.median(self.history)

    def is_spike(self, value: float | None) -> bool:
        limit = self.threshold()
        return limit is not None and value is not None and math.isfinite(value) and value > limit

    def accept(self, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.history.append(value)


@dataclass
class StepInputs:
    """What a step changes before its update, saved so that it can run again from the same state:
    with gradient compression the residuals and variance statistics (the reducer's state dict)
    and, for 1-bit Adam and DGC, the momentum with the ZeRO seed shard (``rerun_state``: the
    between-step state the checkpoint's view lacks)."""
    scaler: dict
    reducer_step: int
    residuals: dict
    rng: list
    momenta: list = field(default_factory=list)   # [(compressor, its rerun_state())]

    @classmethod
    def capture(cls, stepper, rng_sources) -> "StepInputs":
        state = stepper.reducer.state_dict()
        residuals = {k: v.clone() for k, v in state["residuals"].items()  # only with compression
                     if not k.endswith(".momentum")}  # (copied with the seed shard, below)
        momenta = [(c, c.rerun_state()) for c in _compressors(stepper.reducer)
                   if hasattr(c, "rerun_state")]
        return cls(dict(stepper.scaler.state_dict()), state["step"], residuals,
                   [get() for get, _ in rng_sources], momenta)

    def restore(self, stepper, rng_sources) -> None:
        stepper.scaler.load_state_dict(self.scaler)
        stepper.reducer.load_state_dict({"step": self.reducer_step, "residuals": self.residuals})
        for compressor, state in self.momenta:
            compressor.load_rerun_state(state)
        for (_, put), state in zip(rng_sources, self.rng):
            if state is not None:
                put(state)


def _compressors(reducer) -> list:
    return [c for c in (getattr(b, "compressor", None) for b in reducer.buckets) if c is not None]


@dataclass
class Finding:
    """One rank's evidence about one execution of the step."""
    rank: int
    norm_nonfinite: bool
    norm_spike: bool
    bad_params: int           # parameters whose local gradient (before the DP reduction) was non-finite
    loss_micro: int           # first micro-batch whose loss was non-finite here (-1: none)
    grad_micro: int           # first micro-batch with a non-finite gradient (-1: none, or not checked)
    first_param: str | None   # the first non-finite gradient, in backward order

    @property
    def bad(self) -> bool:
        return self.bad_params > 0 or self.loss_micro >= 0

    def encode(self) -> list[int]:
        name = (self.first_param or "")[:NAME_CHARS]
        codes = [ord(c) for c in name]
        return [int(self.norm_nonfinite), int(self.norm_spike), self.bad_params, self.loss_micro,
                self.grad_micro, len(codes), *codes, *[0] * (NAME_CHARS - len(codes))]

    @classmethod
    def decode(cls, rank: int, row: list[int]) -> "Finding":
        n = row[5]
        name = "".join(chr(c) for c in row[HEAD:HEAD + n]) if n else None
        return cls(rank, bool(row[0]), bool(row[1]), row[2], row[3], row[4], name)


class LocalProbe:
    """This rank's evidence: per-parameter finiteness of the local gradients at each bucket's
    launch (device tensors, read only on an anomaly) and, while ``per_micro_batch()`` is active,
    of every micro-batch's gradient."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.order = [(b.index, [s.name for s in b.slots]) for b in reducer.buckets]
        self.norms: dict[int, torch.Tensor] = {}
        self.micro: dict[str, list] | None = None      # name -> [non-finite?] per micro-batch
        self.deferred: dict[str, list] = {}            # name -> [(micro-batch, non-finite?)] from W
        reducer.pre_reduce_hooks.append(self.on_launch)

    def reset(self) -> None:
        self.norms = {}

    def on_launch(self, bucket) -> None:
        data = bucket.data   # (the bucket's range of the buffer, or its ZeRO-2/3 storage)
        views = [data[s.start - bucket.start:s.end - bucket.start]
                 for s in bucket.slots]  # this rank's own gradients
        self.norms[bucket.index] = torch.stack(torch._foreach_norm(views))  # (params,)

    @contextmanager
    def per_micro_batch(self, weight_grads=None):
        """Record every parameter's gradient finiteness per micro-batch: tensor hooks run before
        the gradient is accumulated, once per backward of each micro-batch; under a zero-bubble
        schedule a weight whose gradient waits for W gets None there, and is checked where W has
        accumulated it (``weight_grads``: the B/W split's store, which knows the micro-batch;
        the accumulated gradient turns non-finite at the first bad micro-batch and stays so)."""
        self.micro, self.deferred = {}, {}
        handles, names = [], {}
        for b in self.reducer.buckets:
            for s in b.slots:
                self.micro[s.name], self.deferred[s.name], names[id(s.param)] = [], [], s.name
                handles.append(s.param.register_hook(
                    lambda g, name=s.name: None if g is None else
                    self.micro[name].append(~torch.isfinite(g).all())))

        def after_w(key, param):
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad   # (ZeRO-2/3 before the bucket's storage)
            if id(param) in names and grad is not None:
                self.deferred[names[id(param)]].append((key[0], ~torch.isfinite(grad).all()))
        hooks = weight_grads.accumulated_hooks if weight_grads is not None else []
        hooks.append(after_w)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            hooks.remove(after_w)

    def first_bad_micro(self, name: str) -> int:
        """The re-run's first micro-batch whose gradient of ``name`` was non-finite (-1: none)."""
        seen = list(enumerate(self.micro.get(name, ()))) + self.deferred.get(name, [])
        if not seen:
            return -1
        flags = torch.stack([flag for _, flag in seen]).tolist()
        return min((m for (m, _), bad in zip(seen, flags) if bad), default=-1)

    def finding(self, rank: int, verdicts: tuple[int, int], micro_losses) -> Finding:
        names, bad = [], []
        for index, bucket_names in self.order:
            if index in self.norms:  # every bucket is launched once per execution
                names += bucket_names
                bad += (~torch.isfinite(self.norms[index])).tolist()
        bad_names = [n for n, b in zip(names, bad) if b]
        loss_micro = -1
        if micro_losses is not None:
            flags = (~torch.isfinite(micro_losses.float())).tolist()
            loss_micro = flags.index(True) if True in flags else -1
        grad_micro, first = -1, bad_names[0] if bad_names else None
        if self.micro is not None:
            hits = []  # (first bad micro-batch, backward position, name)
            for i, name in enumerate(names):
                micro = self.first_bad_micro(name)
                if micro >= 0:
                    hits.append((micro, i, name))
            if hits:
                grad_micro, _, first = min(hits)
            self.micro, self.deferred = None, {}
        return Finding(rank, bool(verdicts[0]), bool(verdicts[1]), len(bad_names), loss_micro,
                       grad_micro, first)


@dataclass
class Anomaly:
    """One anomalous step: what was seen, the findings of each execution, and the verdict."""
    step: int | None
    why: str
    findings: list[Finding]
    again: str | None = None                 # why the re-run was anomalous too (None: it was clean)
    rerun_findings: list[Finding] = field(default_factory=list)
    rerun: bool = False

    @property
    def verdict(self) -> str | None:
        if not self.rerun:
            return None
        return "persistent" if self.again is not None else "transient"

    def origin(self, grid=None) -> list[Finding]:
        """Ranks with evidence, nearest to the fault first: later pipeline stages first (the
        backward pass starts at the last stage and carries a fault to earlier ones), then by rank."""
        evidence = [f for f in (self.rerun_findings if self.again else self.findings) if f.bad] or \
            [f for f in self.findings if f.bad]
        stage = (lambda r: -grid.coord(r).pp) if grid is not None else (lambda r: 0)
        return sorted(evidence, key=lambda f: (stage(f.rank), f.rank))

    def describe(self, grid=None) -> str:
        def who(r):
            if grid is None:
                return f"rank {r}"
            c = grid.coord(r)
            return f"rank {r} (tp {c.tp}/{grid.tp}, pp {c.pp}/{grid.pp}, dp {c.dp}/{grid.dp})"

        def where(f: Finding) -> str:
            parts = []
            if f.loss_micro >= 0:
                parts.append(f"non-finite loss in micro-batch {f.loss_micro}")
            if f.bad_params:
                micro = f"micro-batch {f.grad_micro}" if f.grad_micro >= 0 else \
                    ("micro-batch unknown (it did not repeat on the re-run, which checks each one)"
                     if self.rerun and self.again is None else "micro-batch unknown")
                parts.append(f"{micro}, first non-finite gradient {f.first_param} ({f.bad_params} "
                             f"parameter{'s' if f.bad_params > 1 else ''} non-finite before the "
                             f"data-parallel reduction)")
            return f"{who(f.rank)}: " + "; ".join(parts)

        text = f"step {self.step}: {self.why}"
        if self.rerun:
            text += ("; run again from the step's saved inputs: it repeated (" + self.again +
                     "): persistent, from the data or the model" if self.again is not None else
                     "; run again from the step's saved inputs: it did not repeat: transient "
                     "(hardware or a one-off fault); the clean re-run is applied")
        ranks = self.origin(grid)
        if ranks:
            text += ". " + "; ".join(where(f) for f in ranks[:4])
            if len(ranks) > 4:
                text += f"; and {len(ranks) - 4} more ranks"
        elif self.findings and any(f.norm_nonfinite or f.norm_spike for f in self.findings):
            text += ". No rank's own gradients were non-finite before the reduction"
        return text


class AnomalyGuard:
    """Reviews each step between its gradient check and its update (``Stepper.guard``)."""

    def __init__(self, ps, reducer, precision: str, spike_factor: float = 0.0,
                 spike_window: int = 32, rerun: bool = False, rng_sources=None,
                 last_checkpoint=None, note=None):
        self.ps, self.precision, self.rerun = ps, precision, rerun
        self.loss_spikes = SpikeDetector(spike_factor, spike_window)
        self.norm_spikes = SpikeDetector(spike_factor, spike_window)
        self.probe = LocalProbe(reducer) if rerun else None
        self.rng_sources = rng_sources if rng_sources is not None else \
            [(torch.get_rng_state, torch.set_rng_state)]
        self.last_checkpoint = last_checkpoint or (lambda: None)
        self.note = note or (lambda text: None)
        self.inputs: StepInputs | None = None
        self.verdicts = (0, 0)
        self.last: Anomaly | None = None   # this step's anomaly, if any
        self.anomalies: list[Anomaly] = []

    @classmethod
    def for_trainer(cls, trainer) -> "AnomalyGuard | None":
        o = trainer.cfg.optim
        if not (o.rerun_on_anomaly or o.spike_factor > 0):
            return None
        dev = trainer.dev
        sources = [(torch.get_rng_state, torch.set_rng_state)]
        if dev.type != "cpu":
            sources.append((dev.get_rng_state, dev.set_rng_state))
        rng = getattr(trainer, "rng", None)  # per-region dropout streams, where the trainer has them
        if rng is not None and hasattr(rng, "state_tensors"):
            sources.append((rng.state_tensors, rng.load_state_tensors))

        def note(text):
            if trainer.is_main:
                print(f"gridtron: {text}", flush=True)
        guard = cls(trainer.ps, trainer.reducer, trainer.cfg.precision.precision, o.spike_factor,
                    o.spike_window, o.rerun_on_anomaly, sources, trainer.last_checkpoint, note)
        trainer.stepper.guard = guard
        return guard

    # ---- the fast path ---------------------------------------------------------------------
    def before(self, stepper) -> None:
        self.last = None
        if self.rerun:
            self.inputs = StepInputs.capture(stepper, self.rng_sources)
            self.probe.reset()

    def judge(self, pre) -> tuple[str, bool] | None:
        """(why, non-finite?) when this execution is anomalous, the same on every rank; None when
        it is not. The loss and the gradient norm come out of the step's statistics all-reduce
        (engine/training/step.py), identical on every rank, so every rank judges the same numbers."""
        nonfinite_norm = bool(pre.check.skipped) and self.precision != "fp16"  # fp32/bf16: inf/nan norm
        spiking_norm = self.norm_spikes.is_spike(pre.check.grad_norm)
        self.verdicts = (int(nonfinite_norm), int(spiking_norm))
        if self.precision != "fp16" and not math.isfinite(pre.loss):
            return f"non-finite loss ({pre.loss})", True
        if nonfinite_norm:
            return "non-finite gradient norm", True
        for name, value, spikes in (("gradient-norm", pre.check.grad_norm, self.norm_spikes),
                                    ("loss", pre.loss, self.loss_spikes)):
            if (name == "loss" or spiking_norm) and spikes.is_spike(value):
                median = spikes.threshold() / spikes.factor
                return (f"{name} spike ({value:.4g} > --spike-factor {spikes.factor:g} x the "
                        f"median {median:.4g} of the last {len(spikes.history)} steps)"), False
        return None

    def _accept(self, pre) -> None:
        self.loss_spikes.accept(pre.loss)
        self.norm_spikes.accept(pre.check.grad_norm)

    # ---- the slow path ---------------------------------------------------------------------
    def gather(self, stepper) -> list[Finding]:
        """Every rank's findings about the execution just run: one int32 all-gather."""
        mine = self.probe.finding(self.ps.rank, self.verdicts, stepper.micro_losses)
        t = torch.tensor(mine.encode(), dtype=torch.int32, device=self.ps.device)
        world = self.ps.world_size
        out = torch.empty(world * WIDTH, dtype=torch.int32, device=self.ps.device)
        self.ps.world_group.all_gather_into(out, t)
        return [Finding.decode(r, row) for r, row in enumerate(out.view(world, WIDTH).tolist())]

    def review(self, stepper, batches, pre, step):
        seen = self.judge(pre)
        if seen is None:
            self._accept(pre)
            return pre
        if not self.rerun:
            self.last = Anomaly(step, seen[0], [])
            self.anomalies.append(self.last)
            self.note(self.last.describe(self.ps.grid))
            return pre
        first = self.gather(stepper)
        self.inputs.restore(stepper, self.rng_sources)
        self.probe.reset()
        with self.probe.per_micro_batch(stepper.weight_grads):
            again = stepper.compute(batches).after(pre)  # the step's figures: both runs
        seen_again = self.judge(again)
        report = Anomaly(step, seen[0], first, seen_again[0] if seen_again else None,
                         self.gather(stepper), rerun=True)
        self.last = report
        self.anomalies.append(report)
        text = report.describe(self.ps.grid)
        if seen_again is not None and seen_again[1]:  # non-finite again: nothing to apply
            raise PersistentAnomaly(f"{text}. The run stops", self.last_checkpoint(),
                                    {"loss": again.loss, "grad_norm": again.check.grad_norm,
                                     "loss_scale": again.scale, "skipped": True, **self.record()})
        self.note(text)
        self._accept(again)
        return again

    def record(self) -> dict:
        """This step's metrics keys: ``anomaly`` (what was seen, or null) and ``rerun``
        ("transient", "persistent", or null without a re-run)."""
        a = self.last
        return {"anomaly": a.why if a is not None else None,
                "rerun": a.verdict if a is not None else None}
