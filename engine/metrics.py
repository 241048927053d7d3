"""Per-step metrics: the JSONL file of DESIGN.md, the progress bar and the closing summary.

Only global rank 0 writes. The required keys are listed in REQUIRED_KEYS; the trainer fills them
all (null where a value does not apply, e.g. the bubble without PP).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

REQUIRED_KEYS = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens", "step_time_s",
                 "tokens_per_s", "tflops_per_device", "mfu", "bubble_theoretical",
                 "bubble_measured", "dp_comm_bytes", "dp_comm_wire_bytes", "tp_comm_bytes",
                 "pp_comm_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes",
                 "peak_memory_bytes")


@dataclass
class MetricsLog:
    path: str | None = None
    enabled: bool = True
    progress: bool = True
    total_steps: int = 0
    records: list[dict] = field(default_factory=list)
    _bar: object = None
    _fh: object = None

    def __post_init__(self):
        if not self.enabled:
            return
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fh = open(self.path, "a")
        if self.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=self.total_steps, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stderr)

    def start_at(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise KeyError(f"metrics record misses {missing}")
        self.records.append(record)
        if self._fh:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        if self._bar is not None:
            mfu = record["mfu"]
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                  mfu="n/a" if mfu is None else f"{100 * mfu:.1f}%", refresh=False)
            self._bar.update(1)
        elif self.enabled and not self._bar and record["step"] % 10 == 0:
            print(f"step {record['step']}: loss {record['loss']:.4f}", file=sys.stderr)

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


def summary_table(records: list[dict], extra: dict[str, str]) -> str:
    """A plain-text table summarising a run (timings exclude the first, warm-up step)."""
    if not records:
        return "no steps were run"
    timed = records[1:] or records
    mean = lambda key: sum(r[key] for r in timed if r[key] is not None) / max(
        1, sum(1 for r in timed if r[key] is not None))
    rows = [("steps", f"{records[0]['step']}..{records[-1]['step']}"),
            ("first / last loss", f"{records[0]['loss']:.4f} / {records[-1]['loss']:.4f}"),
            ("skipped steps", str(sum(bool(r["skipped"]) for r in records))),
            ("mean step time", f"{mean('step_time_s'):.3f} s"),
            ("tokens/s", f"{mean('tokens_per_s'):.0f}"),
            ("TFLOP/s per device", f"{mean('tflops_per_device'):.4f}")]
    if any(r["mfu"] is not None for r in timed):
        rows.append(("MFU", f"{100 * mean('mfu'):.2f}%"))
    if records[-1]["bubble_theoretical"] is not None:
        simulated = mean("bubble_simulated") if "bubble_simulated" in records[-1] else None
        rows.append(("bubble (theory / simulated / measured)",
                     f"{records[-1]['bubble_theoretical']:.3f} / "
                     f"{'n/a' if simulated is None else f'{simulated:.3f}'} / "
                     f"{mean('bubble_measured'):.3f}"))
        if records[-1].get("activations_in_flight") is not None:
            rows.append(("micro-batches in flight (rank 0)", str(records[-1]["activations_in_flight"])))
    rows.append(("DP bytes per step", f"{mean('dp_comm_bytes'):.0f}"))
    rows.append(("peak memory", f"{records[-1]['peak_memory_bytes'] / 2**20:.0f} MiB"))
    rows.extend(extra.items())
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * 42 + "+"
    body = [f"| {k:<{width}} | {v:<40} |" for k, v in rows]
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
