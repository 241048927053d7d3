"""The device check's mixture-of-experts stages and their comparison (benchmarks/device_check/).

- ``moe``: the MoE GPT of issue 35 on one device: 12 layers x hidden 1024, 16 heads, 8 experts of
  width 4096, top-2, aux loss 1e-2, seq 2048, bf16, micro-batch 4, global batch 16, mock data;
- ``moe_dense``: the dense GPT with the same active FLOPs (12 x 1024, ffn 8192 = 2 x 4096), in the
  same run, so the ratio of their tokens/s is the MoE layer's cost on this device;
- ``syncs``: the host waits per step counted two ways on the same steps of a small MoE model (and
  a dense one): the engine's dispatch mode, which names the ops a GPU waits for
  (engine/device/sync_ops.py: how CPU tests count), and CUDA's own report of its synchronizing
  operations (``torch.cuda.set_sync_debug_mode``, engine/device/native_syncs.py).

``comparison`` puts the two training stages beside the planner: its step time for both models
on this device (default constants), then the MoE terms ``--calibrate`` fits to these two metrics
files (engine/plan/calibrate_moe.py: the achievable fraction from the dense run, the MoE overhead
and load imbalance from the MoE run).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

MOE_MODEL = {"num-layers": 12, "hidden-size": 1024, "num-attention-heads": 16, "seq-length": 2048,
             "vocab-size": 51200, "ffn-hidden-size": 4096, "num-experts": 8, "moe-router-topk": 2,
             "moe-ffn-hidden-size": 4096, "moe-aux-loss-coeff": 0.01}
DENSE_MODEL = {"num-layers": 12, "hidden-size": 1024, "num-attention-heads": 16, "seq-length": 2048,
               "vocab-size": 51200, "ffn-hidden-size": 8192}
TINY_MOE = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
            "vocab-size": 256, "ffn-hidden-size": 128, "num-experts": 4, "moe-router-topk": 2,
            "moe-ffn-hidden-size": 128, "moe-aux-loss-coeff": 0.01}
TINY_DENSE = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
              "vocab-size": 256, "ffn-hidden-size": 256}
SYNC_STEPS = 4  # the first one (the kernels' first calls) left out of the comparison


def stage_model(name: str, tiny: bool) -> dict | None:
    """The model of an MoE stage (None: the check's default model)."""
    if name == "moe":
        return TINY_MOE if tiny else MOE_MODEL
    if name == "moe_dense":
        return TINY_DENSE if tiny else DENSE_MODEL
    return None


def _shape(model: dict, global_batch: int):
    from engine.plan.flops import moe_layer_indices, moe_shape
    from engine.plan.model import ModelShape
    from models.config import GPTConfig
    keys = {k.replace("-", "_"): v for k, v in model.items()}
    cfg = GPTConfig(**keys)
    return ModelShape(cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size,
                      cfg.seq_length, global_batch, cfg.ffn_hidden_size, cfg.block,
                      fused_attention=True, moe=moe_shape(cfg), moe_layers=moe_layer_indices(cfg))


def planner_rows(device_name: str, tiny: bool, micro_batch: int, global_batch: int,
                 moe_metrics: str | None, dense_metrics: str | None,
                 peak_tflops: float | None = None) -> list[dict]:
    """The planner's step for both models on this device, before and after calibration (empty
    where the device has no spec in engine/plan/hardware.py). ``peak_tflops``: the run's peak,
    for a device the table has none for (the CPU's is measured)."""
    from dataclasses import replace

    from engine.plan.calibrate_moe import calibrate_moe
    from engine.plan.hardware import get_device_spec, lookup_device
    from engine.plan.model import Cluster, Layout
    from engine.plan.timing import estimate
    spec_name = lookup_device(device_name) or ("cpu" if peak_tflops else None)
    if spec_name is None:
        return []
    spec = get_device_spec(spec_name)
    try:
        cluster = Cluster.from_device(spec, 1, peak_tflops=spec.peak_tflops or peak_tflops,
                                      memory_gb=spec.memory_gb or 64.0)
    except ValueError:
        return []
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=micro_batch)
    shapes = {name: _shape(stage_model(name, tiny), global_batch) for name in ("moe", "moe_dense")}
    rows = [{"model": name, "fit": "default constants", "step_time_s":
             estimate(shape, cluster, layout).step_time_s} for name, shape in shapes.items()]
    if moe_metrics and dense_metrics and Path(moe_metrics).exists() and Path(dense_metrics).exists():
        try:
            fitted, notes = calibrate_moe(shapes["moe"], cluster, layout, moe_metrics, dense_metrics)
        except ValueError as exc:
            return rows + [{"model": "moe", "fit": f"calibration failed: {exc}", "step_time_s": None}]
        rows.append({"model": "moe", "fit": "calibrated: " + "; ".join(notes),
                     "step_time_s": estimate(shapes["moe"], fitted, layout).step_time_s,
                     "overhead_ms": 1e3 * fitted.moe_pass_overhead_s})
        rows.append({"model": "moe_dense", "fit": "calibrated fraction", "step_time_s": estimate(
            shapes["moe_dense"], replace(cluster, achievable_fraction=fitted.achievable_fraction),
            layout).step_time_s})
    return rows


def comparison_lines(results, header: dict, out: Path, tiny: bool, micro_batch: int,
                     global_batch: int) -> list[str]:
    """The llama stage against gpt2's, and the MoE stage against its dense reference and the
    planner, as markdown lines. A figure from a stage that did not finish (stopped at its
    deadline or failed: its summary covers the steps it made) is marked as such, not read
    against a target."""
    from benchmarks.common import markdown_table
    by = {r.name: r for r in results if r.summary}
    lines = []
    if "eager" in by and "llama" in by and by["eager"].summary["mfu"] and by["llama"].summary["mfu"]:
        lines += [f"llama / gpt2 blocks (1.3B, eager) MFU: {by['llama'].summary['mfu'] / by['eager'].summary['mfu']:.3f} "
                  f"({100 * by['llama'].summary['mfu']:.1f}% against {100 * by['eager'].summary['mfu']:.1f}%)"
                  + unfinished(by, "eager", "llama"), ""]
    if "moe" not in by:
        return lines
    moe, dense = by["moe"].summary, by.get("moe_dense")
    if dense is not None and moe["tokens_per_s"] and dense.summary["tokens_per_s"]:
        ratio = moe["tokens_per_s"] / dense.summary["tokens_per_s"]
        lines += [f"MoE / dense (same active FLOPs) tokens/s: {ratio:.3f} (target >= 0.8); MoE MFU "
                  f"{100 * (moe['mfu'] or 0):.1f}% (target >= 40%), peak memory "
                  f"{(moe['peak_memory_bytes'] or 0) / 2**30:.1f} GiB"
                  + unfinished(by, "moe", "moe_dense"), ""]
    elif unfinished(by, "moe"):
        lines += [f"MoE MFU {100 * (moe['mfu'] or 0):.1f}% (target >= 40%)" + unfinished(by, "moe"), ""]
    peak = (moe["model_tflops_per_device"] / moe["mfu"]
            if moe.get("mfu") and moe.get("model_tflops_per_device") else None)
    rows = planner_rows(header["device_name"], tiny, micro_batch, global_batch,
                        str(out / "moe.jsonl"), str(out / "moe_dense.jsonl"), peak)
    if rows:
        measured = {name: by[name].summary["step_time_s"] for name in ("moe", "moe_dense") if name in by}
        lines += [markdown_table(["model", "planner", "predicted step (s)", "measured step (s)",
                                  "predicted / measured"],
                                 [[r["model"], r["fit"], _fmt(r["step_time_s"]),
                                   _fmt(measured.get(r["model"])),
                                   _fmt(r["step_time_s"] / measured[r["model"]]
                                        if r["step_time_s"] and measured.get(r["model"]) else None)]
                                  for r in rows]), ""]
        note = unfinished(by, "moe", "moe_dense")
        lines += [f"planner table{note}", ""] if note else []
    return lines


def unfinished(by: dict, *names: str) -> str:
    """A note for a target line whose figures come from stages that did not finish ("" when all
    of ``names`` finished)."""
    left = [f"{n} {by[n].status}" for n in names if n in by and by[n].status != "ok"]
    return (f" -- NOT a result against the targets: from stages that did not finish "
            f"({', '.join(left)})") if left else ""


def _fmt(v):
    return "-" if v is None else f"{v:.4g}"


# ---- the syncs stage ------------------------------------------------------------------------

def count_syncs(device: str, out: Path, tiny: bool) -> list[dict]:
    """Per model, the host waits of each step after the first under the dispatch mode and under
    the device runtime's own report (CUDA), on the same configuration."""
    from engine.config.cli import parse_args
    from engine.device.native_syncs import cuda_sync_warnings
    from engine.device.syncs import SyncCounter
    from engine.training.trainer import Trainer
    small = TINY_MOE if tiny else {**TINY_MOE, "hidden-size": 256, "seq-length": 256,
                                   "moe-ffn-hidden-size": 512, "ffn-hidden-size": 512}
    models = {"moe ep1 dropless": small,
              "moe ep1 padded capacity": {**small, "moe-expert-capacity-factor": 1.0,
                                          "moe-pad-expert-input-to-capacity": True},
              "dense": {k: v for k, v in small.items() if not k.startswith(("moe", "num-exp"))}}
    rows = []
    for name, model in models.items():
        counts = {}
        for how in ("dispatch mode", "cuda runtime"):
            if how == "cuda runtime" and device != "cuda":
                counts[how] = None
                continue
            argv = ["--mock-data", "--device", device, "--precision", "bf16" if device != "cpu" else "fp32",
                    "--no-progress", "--host-sync-interval", "1", "--train-iters", str(SYNC_STEPS), "--lr-warmup-iters", "1",
                    "--micro-batch-size", "2", "--global-batch-size", "4", "--save", "", "--plot", ""]
            for key, value in model.items():
                argv += [f"--{key}"] + ([] if value is True else [str(value)])
            trainer = Trainer(parse_args(argv))
            trainer.clock.syncs = (SyncCounter(strict=True, device_type=device) if how == "dispatch mode"
                                   else SyncCounter(native=cuda_sync_warnings, device_type=device))
            try:
                records = trainer.train().records
            finally:
                trainer.close()
            counts[how] = [r["host_syncs"] for r in records[1:]]
        rows.append({"model": name, **counts,
                     "equal": None if counts["cuda runtime"] is None
                     else counts["cuda runtime"] == counts["dispatch mode"]})
    (out / "syncs.json").write_text(json.dumps(rows, indent=1))
    return rows


def syncs_stage(stage, deadline_s: float, out: Path, kind: str, args):
    """The syncs stage as a subprocess (``python -m benchmarks.device_check.moe``) under its deadline:
    a StageResult, failed where the two counts differ."""
    from benchmarks.device_check.launch import launcher
    from benchmarks.device_check.plan import StageResult, last_line
    data = out / "syncs.json"
    data.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.device_check.moe", kind, str(out)] + (["--tiny"] if args.tiny else [])
    code, wall = launcher(kind)(cmd, out / "syncs.log", deadline_s)
    rows = json.loads(data.read_text()) if code == 0 and data.exists() else []
    differ = [r["model"] for r in rows if r["equal"] is False]
    status = "deadline" if code is None else "failed" if code or differ else "ok"
    detail = {"ok": "", "deadline": f"stopped at its {deadline_s:g} s deadline",
              "failed": f"the counts differ: {', '.join(differ)}" if differ else
              f"exit {code}: {last_line(out / 'syncs.log')}"}[status]
    return StageResult(stage.name, status, deadline_s, wall, detail, syncs=rows)


def syncs_lines(rows: list[dict]) -> list[str]:
    from benchmarks.common import markdown_table
    if not rows:
        return []
    show = lambda v: "-" if v is None else " ".join(map(str, v))  # noqa: E731
    return [markdown_table(["model (steps 2-4)", "host waits: dispatch mode", "host waits: CUDA's report",
                            "equal"],
                           [[r["model"], show(r["dispatch mode"]), show(r["cuda runtime"]),
                             "-" if r["equal"] is None else ("yes" if r["equal"] else "NO")]
                            for r in rows]),
            "", "the dispatch mode names the ops a GPU waits for (how CPU tests count); CUDA's "
                "report is torch.cuda.set_sync_debug_mode's", ""]


def main(argv: list[str]) -> int:
    """``python -m benchmarks.device_check.moe DEVICE OUT [--tiny]``: the syncs stage in a process."""
    device, out = argv[0], Path(argv[1])
    count_syncs(device, out, "--tiny" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
