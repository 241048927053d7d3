"""Per-step metrics: the JSONL file of docs/design.md, the progress bar and the closing summary.

Only global rank 0 writes. The required keys are listed in REQUIRED_KEYS; the trainer fills them
all (null where a value does not apply, e.g. the bubble without PP, or cannot be known);
``valid_loss`` is added on the steps that validate. The file is written from the first step's
record on (a run that fails earlier leaves the old file as it was): a fresh run swaps in a new file
atomically, a run resumed at step k keeps the records of steps 1..k and appends after them. The
progress bar shows the latest step's loss and, like the closing summary, tokens/s and MFU over the
run so far without the warm-up step (``RunningTotals``); without the bar, one console line every
``log_interval`` steps with the same figures. What the keys mean:

- ``step_time_s``: device time of the whole step (an event pair on the device's stream, read after
  the step; ``engine.device.clock.DeviceClock``); ``tokens_per_s`` = tokens / step_time_s.
- ``tflops_per_device``: the FLOPs the step executed (recomputation included, as Megatron-LM and
  the planner report) / step_time_s / devices, and ``hfu`` = that over the dense peak of the run's
  precision; ``model_tflops_per_device``: the model's FLOPs only (no recomputation), and ``mfu`` =
  that over the same peak (engine/observe/utilization.py). Null where the FLOPs or the peak are unknown.
- ``bubble_measured``: per rank, device time in pipeline transfers plus idle before its first and
  after its last action, over the pipeline phase; averaged over ranks (parallel/pipeline/bubble.py).
  ``bubble_simulated``: the schedule replayed with this step's mean forward/backward time per stage
  and its measured transfers (post time, receive latency; parallel/pipeline/transfers.py);
  ``bubble_simulated_compute``: the same replay with free transfers (stage imbalance alone).
- ``time_pp_exposed_s``: seconds a rank's compute waited on pipeline transfers that were already
  on their way (posting, and each wait after both sides had posted), averaged over ranks; null
  when the pipeline's ranks are on more than one host (it compares a peer's post times with this
  rank's waits, which needs one clock), and ``bubble_simulated`` then replays free transfers;
  ``time_dp_exposed_s``: the step's wait in the DP reduction's ``finish`` for collectives still in
  flight after the backward; ``time_zero_gather_exposed_s``: the step's waits for ZeRO's
  overlapped parameter all-gathers (the forward's; under ZeRO-3 the backward's re-gathers too;
  null without the overlap); ``time_tp_exposed_s``: with tp > 1,
  every interval the step spent blocked in a TP-group collective or its wait (null with tp = 1
  and under --compile). Device seconds of global rank 0.
- ``time_forward_backward_s``, ``time_dp_finish_s``, ``time_grad_sync_s``, ``time_clip_s``,
  ``time_optimizer_s``: device seconds of each part of the step on global rank 0 (engine/training/step.py);
  none of them is in the bubble.
- ``*_comm_bytes``: payload this rank handed to each group kind's collectives this step.

Summaries (``summarize_run``) are totals over time with warm-up steps left out (peak memory: the
largest of every step's).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

REQUIRED_KEYS = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens", "step_time_s",
                 "tokens_per_s", "tflops_per_device", "mfu", "hfu", "bubble_theoretical",
                 "bubble_simulated", "bubble_measured", "dp_comm_bytes", "dp_comm_wire_bytes",
                 "tp_comm_bytes", "pp_comm_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes",
                 "peak_memory_bytes", "time_forward_backward_s",
                 "time_dp_finish_s", "time_grad_sync_s", "time_clip_s", "time_optimizer_s")
# optional: the trainer's loop adds them; save_blocking_s is the time the step boundary spent on
# checkpoints (the whole save when synchronous, the host copy and publication with --async-save),
# null where it had none to do
# anomaly: what made the step anomalous (a non-finite or spiking loss or gradient norm), rerun:
# "transient" or "persistent" after a re-run (engine/observe/anomaly.py); straggler_rank / straggler_ratio /
# straggler_waited_for every --log-interval steps (engine/observe/stragglers.py), null on other steps
# warmup: the step is the first its process ran (a run's first, or a resumed run's), whose time
# holds lazy initialisation and compilation
OPTIONAL_KEYS = ("save_blocking_s", "anomaly", "rerun", "straggler_rank", "straggler_ratio",
                 "straggler_waited_for", "warmup")
# mixture of experts (models/moe/step_figures.py), null without MoE layers: the step's balancing
# losses, the per-expert load of the global batch summed over MoE layers, the largest per-layer
# max / mean load, the assignments a capacity dropped, the payload handed to the dispatch
# collectives (null under --compile)
MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_expert_load", "moe_load_imbalance",
            "moe_tokens_dropped", "ep_comm_bytes")


WARMUP_STEPS = 1  # steps the closing summary leaves out (allocator growth, lazy init, compile)


@dataclass
class RunningTotals:
    """The summary's throughput figures so far, updated one record at a time: tokens / seconds and
    MFU = model FLOPs / seconds / devices / peak (each step's MFU weighted by its time) over the
    records after the first ``warmup`` (over the latest alone while only warm-up steps are in),
    exactly as ``summary_table`` computes them at the end."""
    warmup: int = WARMUP_STEPS
    count: int = 0
    seconds: float = 0.0
    tokens: float = 0.0
    mfu_seconds: float | None = 0.0   # sum of mfu x step time; None once a step had no MFU
    last: dict | None = None

    def add(self, record: dict) -> None:
        if record["step_time_s"] is None:  # the step a run stopped on (run_events.record_divergence)
            return
        self.count += 1
        self.last = record
        if self.count <= self.warmup:
            return
        dt = record["step_time_s"]
        self.seconds += dt
        self.tokens += record["tokens"]
        if self.mfu_seconds is not None:
            mfu = record.get("mfu")
            self.mfu_seconds = None if mfu is None or dt is None else self.mfu_seconds + mfu * dt

    @property
    def first_step(self) -> int | None:
        """The first step the figures cover."""
        if self.last is None:
            return None
        return self.last["step"] - (self.count - self.warmup - 1 if self.count > self.warmup else 0)

    def tokens_per_s(self) -> float | None:
        if self.count <= self.warmup:
            r = self.last
            return None if r is None else r["tokens_per_s"]
        return self.tokens / self.seconds if self.seconds > 0 else None

    def mfu(self) -> float | None:
        if self.count <= self.warmup:
            return None if self.last is None else self.last.get("mfu")
        if self.mfu_seconds is None or self.seconds <= 0:
            return None
        return self.mfu_seconds / self.seconds


def percent(value: float | None) -> str:
    """A fraction as the summary prints it: 12.34%, or n/a."""
    return "n/a" if value is None else f"{100 * value:.2f}%"


@dataclass
class MetricsLog:
    """The metrics file, the progress bar (or one console line per interval) and notes, on global
    rank 0. The file is opened at the first record, once the run's first step is done: a run that
    fails before leaves the file of an earlier run as it was. A fresh run then replaces the file
    atomically with a new one (written beside it, swapped in by ``os.replace``); a run resumed at
    step k keeps the records of steps 1..k the same way and appends after them."""
    path: str | None = None
    enabled: bool = True
    progress: bool = True
    total_steps: int = 0
    log_interval: int = 1
    records: list[dict] = field(default_factory=list)
    totals: RunningTotals = field(default_factory=RunningTotals)
    _bar: object = None
    _fh: object = None
    _start: int = 0
    _dir_synced: bool = False

    def __post_init__(self):
        if not self.enabled:
            return
        if self.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=self.total_steps, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    def start_at(self, step: int) -> None:
        """A run that starts after ``step`` completed steps (0: a fresh run). Touches no file."""
        self._start = step
        if self._bar is not None:
            self._bar.update(step)

    def _open(self, first: str) -> None:
        """The file with the records the run keeps (none when fresh) and ``first``, swapped in
        atomically, then open for appending."""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        kept = []
        if self._start and os.path.isfile(self.path):
            with open(self.path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        if json.loads(line)["step"] <= self._start:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a crash
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(kept)
                fh.write(first)
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise KeyError(f"metrics record misses {missing}")
        self.records.append(record)
        self.totals.add(record)
        line = json.dumps(record) + "\n"
        if self.path and self._fh is None:
            self._open(line)
        elif self._fh:
            self._fh.write(line)
        if self._fh:
            self._fh.flush()
        due = record["step"] % self.log_interval == 0 or "valid_loss" in record
        tok_s, mfu = self.totals.tokens_per_s(), self.totals.mfu()
        if self._bar is not None:
            # the latest step's loss; tokens/s and MFU of the run so far, as the summary's
            self._bar.set_postfix(loss=f"{record['loss']:.4f}",
                                  tok_s="n/a" if tok_s is None else f"{tok_s:.0f}",
                                  mfu=percent(mfu), refresh=False)
            self._bar.update(1)
        elif due:
            valid = f" | valid loss {record['valid_loss']:.4f}" if "valid_loss" in record else ""
            span = f"steps {self.totals.first_step}-{record['step']}"
            print(f"step {record['step']}/{self.total_steps}: loss {record['loss']:.4f} | lr "
                  f"{record['lr']:.3g} | {'n/a' if tok_s is None else f'{tok_s:.0f}'} tokens/s, "
                  f"MFU {percent(mfu)} ({span}){valid}", file=sys.stderr)

    def sync(self) -> None:
        """Make every record logged so far durable: flush and fsync the file (a checkpoint becomes
        ``latest`` only after its step's record is on disk: engine/training/trainer.py
        ``before_publish``)."""
        if self._fh:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            if not self._dir_synced:  # the rename that swapped the file in, once
                fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._dir_synced = True

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._fh:
            self._fh.close()




def _weighted(kept: list[dict], key: str, weight: str = "step_time_s") -> float | None:
    """sum(value * weight) / sum(weight): for a per-step rate weighted by the step's time, the
    total over time (e.g. MFU = all model FLOPs / all seconds / devices / peak); None when any
    step lacks the value (the total is then unknown)."""
    pairs = [(r.get(key), r.get(weight)) for r in kept]
    if not pairs or any(v is None or w is None for v, w in pairs):
        return None
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else None


def steady(records: list[dict], warmup: int) -> list[dict]:
    """The records after the first ``warmup`` steps; an error when nothing is left to measure."""
    if warmup < 0:
        raise ValueError(f"warm-up steps must be >= 0, got {warmup}")
    kept = records[warmup:]
    if not kept:
        raise ValueError(f"{len(records)} steps recorded and {warmup} discarded as warm-up: nothing "
                         f"left to measure; raise --steps above --warmup")
    return kept


def summarize_run(records: list[dict], warmup: int = WARMUP_STEPS) -> dict:
    """Totals over time of the steps after the first ``warmup``, never means of per-step rates:
    tokens/s = all tokens / all seconds; TFLOP/s, MFU and HFU = all FLOPs / all seconds (each step's
    rate weighted by its time); the measured and simulated bubbles = idle time / pipeline time
    (weighted by each step's forward/backward phase); bytes and ``time_*`` per step = totals / steps;
    peak memory the largest of every step's, warm-up included. Shared by the trainer's closing
    table and the benchmarks (benchmarks/common.py)."""
    kept = steady(records, warmup)
    seconds = sum(r["step_time_s"] for r in kept)
    tokens = sum(r["tokens"] for r in kept)
    phase = "time_forward_backward_s" if all(r.get("time_forward_backward_s") is not None
                                            for r in kept) else "step_time_s"
    per_step = lambda key: (None if any(r.get(key) is None for r in kept)  # noqa: E731
                            else sum(r[key] for r in kept) / len(kept))
    out = {"steps": len(kept), "warmup": warmup, "first_step": kept[0].get("step"),
           "last_step": kept[-1].get("step"), "seconds": seconds, "tokens": tokens,
           "step_time_s": seconds / len(kept),
           "tokens_per_s": tokens / seconds if seconds > 0 else None,
           "tflops_per_device": _weighted(kept, "tflops_per_device"),
           "model_tflops_per_device": _weighted(kept, "model_tflops_per_device"),
           "mfu": _weighted(kept, "mfu"), "hfu": _weighted(kept, "hfu"),
           "bubble_theoretical": kept[-1].get("bubble_theoretical"),
           "bubble_simulated": _weighted(kept, "bubble_simulated", phase),
           "bubble_measured": _weighted(kept, "bubble_measured", phase),
           "bubble_simulated_compute": _weighted(kept, "bubble_simulated_compute", phase)}
    for key in ("dp_comm_bytes", "dp_comm_wire_bytes", "tp_comm_bytes", "pp_comm_bytes",
                "time_forward_backward_s", "time_dp_finish_s", "time_grad_sync_s", "time_clip_s",
                "time_optimizer_s", "time_pp_exposed_s", "time_dp_exposed_s",
                "time_zero_gather_exposed_s", "time_tp_exposed_s"):
        out[key] = per_step(key)
    # a peak is a peak: the warm-up steps' count too
    out["peak_memory_bytes"] = max((r.get("peak_memory_bytes") or 0) for r in records) or None
    out.update(summarize_moe(kept))
    return out


def summarize_moe(kept: list[dict]) -> dict:
    """The MoE totals of the kept steps: EP bytes per step (None when a step has none: under
    --compile), the load summed over the steps, the imbalance as the steps' figure's numerator
    (the most imbalanced layer's largest expert load) and denominator (its mean) each summed over
    the steps (every layer's mean load is the step's tokens x K / E, so each step weighs by its
    load), the dropped assignments in all; empty without MoE."""
    loads = [r.get("moe_expert_load") for r in kept]
    if any(load is None for load in loads):
        return {}
    total = [sum(col) for col in zip(*loads)]
    ep = [r.get("ep_comm_bytes") for r in kept]
    figures = [(r.get("moe_load_imbalance"), sum(load)) for r, load in zip(kept, loads)]
    weight = sum(w for _, w in figures)
    return {"ep_comm_bytes": None if None in ep else sum(ep) / len(kept), "moe_expert_load": total,
            "moe_load_imbalance": None if not weight or any(v is None for v, _ in figures)
            else sum(v * w for v, w in figures) / weight,
            "moe_tokens_dropped": sum(r["moe_tokens_dropped"] for r in kept)}


def summary_table(records: list[dict], extra: dict[str, str], warmup: int = WARMUP_STEPS) -> str:
    """A plain-text table closing a run: losses over all steps; throughput, utilisation, bubble and
    times as totals over the steps after ``warmup`` warm-up steps (the table says which)."""
    if not records:
        return "no steps were run"
    warmup = min(warmup, len(records) - 1)
    s = summarize_run(records, warmup)
    pct = percent
    num = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    timed = f"{s['first_step']}..{s['last_step']}" + (
        f" ({warmup} warm-up step{'s' if warmup > 1 else ''} left out)" if warmup else
        " (no warm-up step left out)")
    rows = [("steps", f"{records[0]['step']}..{records[-1]['step']}"),
            ("first / last loss", f"{records[0]['loss']:.4f} / {records[-1]['loss']:.4f}"),
            ("skipped steps", str(sum(bool(r["skipped"]) for r in records))),
            ("timed steps", timed),
            ("step time (total / steps)", f"{s['step_time_s']:.3f} s"),
            ("tokens/s (tokens / seconds)", num(s["tokens_per_s"], ".0f")),
            ("TFLOP/s per device (executed / model)",
             f"{num(s['tflops_per_device'], '.4f')} / {num(s['model_tflops_per_device'], '.4f')}"),
            ("MFU / HFU", f"{pct(s['mfu'])} / {pct(s['hfu'])}")]
    if s["bubble_theoretical"] is not None:
        rows.append(("bubble (theory / simulated / measured)",
                     f"{s['bubble_theoretical']:.3f} / {num(s['bubble_simulated'], '.3f')} / "
                     f"{num(s['bubble_measured'], '.3f')}"))
        if s["time_pp_exposed_s"] is not None:
            rows.append(("bubble simulated with free transfers / exposed PP transfers",
                         f"{num(s['bubble_simulated_compute'], '.3f')} / "
                         f"{s['time_pp_exposed_s']:.4f} s per step"))
        if records[-1].get("activations_in_flight") is not None:
            rows.append(("micro-batches in flight (rank 0)", str(records[-1]["activations_in_flight"])))
    if s["time_forward_backward_s"] is not None:
        rows.append(("fwd+bwd / DP finish / optimizer",
                     f"{s['time_forward_backward_s']:.3f} / {s['time_dp_finish_s']:.3f} / "
                     f"{s['time_optimizer_s']:.3f} s"))
    if s["time_dp_exposed_s"] is not None:
        gather = s["time_zero_gather_exposed_s"]
        rows.append(("exposed DP reduction / ZeRO gather",
                     f"{s['time_dp_exposed_s']:.4f} / "
                     f"{'n/a' if gather is None else format(gather, '.4f')} s per step"))
    if s["time_tp_exposed_s"] is not None:
        rows.append(("exposed TP communication", f"{s['time_tp_exposed_s']:.4f} s per step"))
    rows.append(("DP bytes per step", num(s["dp_comm_bytes"], ".0f")))
    if "moe_expert_load" in s:
        last = records[-1]
        rows += [("MoE aux / z loss (last step)",
                  f"{num(last.get('moe_aux_loss'), '.4g')} / {num(last.get('moe_z_loss'), '.4g')}"),
                 ("MoE load imbalance (max / mean)", num(s["moe_load_imbalance"], ".3f")),
                 ("MoE assignments dropped", str(s["moe_tokens_dropped"])),
                 ("EP bytes per step", num(s["ep_comm_bytes"], ".0f"))]
    rows.append(("peak memory", f"{(s['peak_memory_bytes'] or 0) / 2**20:.0f} MiB"))
    rows.extend(extra.items())
    return _table(rows)


SUMMARY_VALUE_WIDTH = 96  # a longer value continues on the next lines, split at spaces


def _table(rows: list[tuple[str, object]]) -> str:
    """Two columns in a box; a value longer than ``SUMMARY_VALUE_WIDTH`` is wrapped at spaces onto
    continuation lines whose first cell is empty (a path without spaces stays whole)."""
    import textwrap
    cells = []
    for key, value in rows:
        parts = textwrap.wrap(str(value), SUMMARY_VALUE_WIDTH, break_long_words=False,
                              break_on_hyphens=False) or [""]
        cells += [(key, parts[0])] + [("", part) for part in parts[1:]]
    width = max(len(k) for k, _ in cells)
    value_width = max(40, *(len(v) for _, v in cells))
    line = "+" + "-" * (width + 2) + "+" + "-" * (value_width + 2) + "+"
    body = [f"| {k:<{width}} | {v:<{value_width}} |" for k, v in cells]
    return "\n".join([line, *body, line])


def plot_metrics(records: list[dict], path: str, valid: list[tuple[int, float]] = ()) -> str:
    """Loss (train and validation) and throughput against step, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["loss"] for r in records], label="train")
    if valid:
        ax1.plot([s for s, _ in valid], [v for _, v in valid], "o-", label="validation")
    ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.grid(alpha=0.3)
    ax2.plot(steps, [r["tokens_per_s"] for r in records])
    ax2.set_xlabel("step"), ax2.set_ylabel("tokens/s"), ax2.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
