"""The device check's FP8 stage (benchmarks/device_check/): bf16 against FP8 GEMMs on one device.

For each model, two ``engine.train`` runs on the same batches of real text (same seed, same
steps): bf16, then ``--fp8-format hybrid`` (tensorwise scales, docs/precision.md; the device
check's ``--fp8-recipe rowwise|blockwise`` runs that recipe instead, blockwise in e4m3). The text is
the repository's own documentation (docs/*.md and README.md, about 0.6 M bytes), prepared at the
stage's start under the stage's out dir with the engine's byte tokenizer
(``python -m engine.data prepare``, a few seconds): uniform random tokens (mock data) cannot show
a loss gap, since every run that does not diverge sits at ln V. The prepared text's
tokenizer description (``PREFIX.json``) is removed, so the data reads as Megatron's own data,
which carries none, and the models keep the check's vocabulary (``--vocab-size``, 51200: the same
models, output layer included, as on mock data; the byte ids use 257 of its tokens). Reported
per model: tokens/s of each
(totals over the steps after the warm-up), their ratio, and the mean loss of the last
``LOSS_WINDOW`` steps of each with its relative gap; each figure against its target (issue 36):

- ``gpt 1.3b``: the check's 1.3B GPT (24 x 2048, seq 2048): FP8 >= 1.1x bf16 tokens/s;
- ``gpt hidden 4096``: hidden 4096, 32 heads, seq 2048, ffn 16384, as many layers as the planner's
  memory model fits on the device with ZeRO off, in the table's memory and in what the device has
  free (``wide_layers``, at most ``WIDE_MAX_LAYERS``, so the stage fits its deadline; 12 on an
  H100 and an H200): FP8 >= 1.25x;
- both: the FP8 run's loss within 1% of bf16's.

A chip without FP8 (an A100, Ascend A2/A3; the chip table's ``fp8_problem``) skips the stage with
the table's line, launching nothing. ``--tiny`` runs one pair of a small bf16 model on the CPU,
whose ``torch._scaled_mm`` runs the same FP8 path (how the tests exercise the stage, in two short
processes, at a learning rate of ``TINY_LR`` so that a few steps move the loss; not a speed
figure).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

WIDE = {"hidden-size": 4096, "num-attention-heads": 32, "seq-length": 2048, "vocab-size": 51200,
        "ffn-hidden-size": 16384}
WIDE_MAX_LAYERS = 12           # about 2.6B parameters: each of its two runs fits a share of the
                               # stage's deadline (the weights are drawn on the host first)
WIDE_DEFAULT_LAYERS = 8        # a device the hardware table has no memory figure for
FREE_MARGIN = 6 * 2 ** 30      # kept back from the free memory: the run's own device context, the
                               # fp32 logits' transients the memory model leaves out
TINY_FP8 = {"num-layers": 1, "hidden-size": 32, "num-attention-heads": 2, "seq-length": 32,
            "vocab-size": 512}   # --tiny: the smallest model with 16-aligned GEMMs (two short
                                 # runs) whose vocabulary holds the byte ids (257)
TARGETS = {"gpt 1.3b": 1.1, "gpt hidden 4096": 1.25}   # FP8 / bf16 tokens/s
LOSS_TARGET = 0.01                                     # relative gap of the mean loss
LOSS_WINDOW = 3                                        # the last steps whose loss is averaged
FP8_FLAGS = ("--fp8-format", "hybrid")   # the default pair: tensorwise scales
RECIPE_FLAGS = {"rowwise": ("--fp8-format", "hybrid", "--fp8-recipe", "rowwise"),
                "blockwise": ("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")}
TINY_LR = ("--lr", "3e-3")     # --tiny: a rate at which the loss falls within a few steps
DATA_INPUTS = ("docs", "README.md")  # the repository's text the pairs train on (byte tokens)


def fp8_flags(recipe: str) -> tuple:
    """The FP8 run's flags for ``--fp8-recipe`` (the device check's option; tensorwise: FP8_FLAGS)."""
    return FP8_FLAGS if recipe == "tensorwise" else RECIPE_FLAGS[recipe]


def prepare_text(out: Path, kind: str, deadline_s: float) -> tuple[str | None, str]:
    """(the prefix of the stage's byte-tokenized text, "") or (None, why not): DATA_INPUTS
    prepared by ``python -m engine.data prepare`` under ``out/fp8_data``."""
    from benchmarks.common import REPO
    from benchmarks.device_check.launch import launcher
    from benchmarks.device_check.plan import last_line
    prefix, log = out / "fp8_data" / "text", out / "fp8_data.log"
    cmd = [sys.executable, "-m", "engine.data", "prepare", "--input",
           *(str(REPO / name) for name in DATA_INPUTS), "--ext", ".md", "--output", str(prefix),
           "--tokenizer", "byte", "--no-progress", "--overwrite"]
    code, _ = launcher(kind)(cmd, log, deadline_s)
    if code == 0:   # without its tokenizer description: --vocab-size then sets the vocabulary
        for suffix in (".json", ".tokenizer.json"):
            Path(f"{prefix}{suffix}").unlink(missing_ok=True)
        return str(prefix), ""
    return None, ("the text's preparation stopped at its deadline" if code is None
                  else f"the text's preparation: exit {code}: {last_line(log)}")


def data_argv(argv: list[str], prefix: str) -> list[str]:
    """``train_argv``'s flags with the prepared text in place of mock data (the vocabulary stays
    ``--vocab-size``).

    >>> data_argv(["--mock-data", "--seq-length", "32", "--vocab-size", "256"], "d/text")
    ['--data-path', 'd/text', '--seq-length', '32', '--vocab-size', '256']
    """
    return [x for flag in argv for x in (["--data-path", prefix] if flag == "--mock-data" else [flag])]


def wide_layers(device_name: str, micro_batch: int, global_batch: int,
                free_bytes: int | None = None) -> int:
    """The most layers (<= WIDE_MAX_LAYERS) of the hidden-4096 GPT whose FP8 training state
    (weights, fp32 gradients and Adam state without ZeRO, activations, logits, FP8 copies) the
    planner's memory model fits in the device's usable memory (engine/plan/memory.py): the
    table's figure, and where ``free_bytes`` (the device's free memory, measured) is given, at
    most that less ``FREE_MARGIN``."""
    from engine.plan.hardware import DEVICE_SPECS, lookup_device
    from engine.plan.memory import memory_per_device
    from engine.plan.model import GIB, MEMORY_USABLE_FRACTION, Layout, ModelShape
    key = lookup_device(device_name)
    memory_gb = DEVICE_SPECS[key].memory_gb if key else None
    if not memory_gb:
        return WIDE_DEFAULT_LAYERS
    budget = memory_gb * GIB * MEMORY_USABLE_FRACTION
    if free_bytes is not None:
        budget = min(budget, free_bytes - FREE_MARGIN)
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=micro_batch)
    best = 1
    for layers in range(1, WIDE_MAX_LAYERS + 1):
        shape = ModelShape(layers, WIDE["hidden-size"], WIDE["num-attention-heads"], WIDE["vocab-size"],
                           WIDE["seq-length"], global_batch, WIDE["ffn-hidden-size"], "gpt2",
                           fused_attention=True, fp8_recipe="tensorwise")
        if memory_per_device(shape, layout, "nccl").total > budget:
            break
        best = layers
    return best


def fp8_models(tiny: bool, device_name: str, micro_batch: int, global_batch: int,
               free_bytes: int | None = None) -> dict:
    """name -> the engine.train model flags of each pair the stage runs (``tiny``: one small pair
    in place of the 1.3B GPT)."""
    from benchmarks.device_check.plan import MODEL
    if tiny:
        return {"gpt 1.3b": TINY_FP8}
    layers = wide_layers(device_name, micro_batch, global_batch, free_bytes)
    return {"gpt 1.3b": MODEL, "gpt hidden 4096": {"num-layers": layers, **WIDE}}


def compare(bf16: dict | None, fp8: dict | None, target: float) -> dict:
    """One model's row from its two runs ({"summary", "losses"} each, or None when not run)."""
    row = {"bf16_tokens_per_s": None, "fp8_tokens_per_s": None, "ratio": None, "target": target,
           "bf16_loss": None, "fp8_loss": None, "loss_gap": None, "speed_met": None, "loss_met": None}

    def loss(run: dict) -> float:   # the mean of the last LOSS_WINDOW steps
        tail = run["losses"][-LOSS_WINDOW:]
        return sum(tail) / len(tail)
    if bf16:
        row["bf16_tokens_per_s"], row["bf16_loss"] = bf16["summary"]["tokens_per_s"], loss(bf16)
    if fp8:
        row["fp8_tokens_per_s"], row["fp8_loss"] = fp8["summary"]["tokens_per_s"], loss(fp8)
    if bf16 and fp8 and len(bf16["losses"]) == len(fp8["losses"]):
        if row["bf16_tokens_per_s"] and row["fp8_tokens_per_s"]:
            row["ratio"] = row["fp8_tokens_per_s"] / row["bf16_tokens_per_s"]
            row["speed_met"] = row["ratio"] >= target
        row["loss_gap"] = row["fp8_loss"] / row["bf16_loss"] - 1
        row["loss_met"] = abs(row["loss_gap"]) <= LOSS_TARGET
    return row


def fp8_stage(stage, deadline_s: float, out: Path, kind: str, args):
    """The stage: a StageResult whose ``fp8`` holds one row per model (``compare``: its losses
    are the means of the last ``LOSS_WINDOW`` steps) and the prepared text's prefix; every run is
    a subprocess under an equal share of what is left of the stage's deadline."""
    from benchmarks.common import read_jsonl
    from benchmarks.device_check.launch import launcher
    from benchmarks.device_check.plan import StageResult, last_line, train_argv
    from engine.device.chips import fp8_problem
    from engine.device.runtime import available_memory, setup_device
    from engine.observe.metrics import summarize_run
    dev = setup_device(kind, 0)
    problem = fp8_problem(dev.type, dev.name, dev.capability)
    if problem:
        return StageResult(stage.name, "skipped", deadline_s, None, problem)
    steps = min(stage.steps or args.steps, args.steps)
    free = available_memory(kind)[0] if kind != "cpu" else None   # this process's context taken
    models = fp8_models(args.tiny, dev.name, args.micro_batch_size, args.global_batch_size, free)
    jobs = [(name, prec, model) for name, model in models.items() for prec in ("bf16", "fp8")]
    start, runs = time.monotonic(), {}
    end = start + deadline_s
    data, failure = prepare_text(out, kind, min(60.0, deadline_s / 4))
    if data is None:
        return StageResult(stage.name, "deadline" if "deadline" in failure else "failed", deadline_s,
                           time.monotonic() - start, failure, fp8={"steps": steps, "rows": {}})
    common = TINY_LR if args.tiny else ()
    recipe = getattr(args, "fp8_recipe", "tensorwise")
    for i, (name, prec, model) in enumerate(jobs):
        tag = f"fp8_{name.replace(' ', '_').replace('.', '')}_{prec}"
        metrics, log = out / f"{tag}.jsonl", out / f"{tag}.log"
        metrics.unlink(missing_ok=True)
        flags = common + (fp8_flags(recipe) if prec == "fp8" else ())
        cmd = [sys.executable, "-m", "engine.train", *data_argv(
            train_argv(kind, steps, str(metrics), str(out / tag), flags, args.micro_batch_size,
                       args.global_batch_size, model, "bf16"), data)]
        code, _ = launcher(kind)(cmd, log, max(1.0, (end - time.monotonic()) / (len(jobs) - i)))
        records = read_jsonl(metrics) if metrics.exists() else []
        if code == 0 and len(records) == steps:
            runs[(name, prec)] = {"summary": summarize_run(records, min(args.warmup, steps - 1)),
                                  "losses": [r["loss"] for r in records]}
        elif not failure:
            failure = (f"{name} {prec}: stopped at its share of the deadline after {len(records)} of "
                       f"{steps} steps" if code is None else f"{name} {prec}: exit {code}: {last_line(log)}")
    rows = {name: {"model": _describe(model), **compare(runs.get((name, "bf16")), runs.get((name, "fp8")),
                                                        TARGETS[name])}
            for name, model in models.items()}
    status = "ok" if len(runs) == len(jobs) else "failed" if "exit" in failure else "deadline"
    return StageResult(stage.name, status, deadline_s, time.monotonic() - start, failure,
                       fp8={"steps": steps, "loss_window": LOSS_WINDOW, "data": data, "rows": rows,
                            "flags": " ".join(fp8_flags(recipe))})


def _describe(model: dict) -> str:
    return (f"{model['num-layers']} x {model['hidden-size']}, {model['num-attention-heads']} heads, "
            f"seq {model['seq-length']}")


def fp8_lines(results) -> list[str]:
    """The stage's table as markdown lines (none when it did not run)."""
    from benchmarks.common import markdown_table
    got = next((r.fp8 for r in results if getattr(r, "fp8", None)), None)
    if not got:
        return []
    num = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    met = lambda v: "-" if v is None else ("met" if v else "missed")  # noqa: E731
    rows = [[name, r["model"], num(r["bf16_tokens_per_s"], ".0f"), num(r["fp8_tokens_per_s"], ".0f"),
             num(r["ratio"], ".3f"), f">= {r['target']:g}x: {met(r['speed_met'])}",
             num(r["bf16_loss"], ".4f"), num(r["fp8_loss"], ".4f"), num(r["loss_gap"], "+.2%"),
             f"within {LOSS_TARGET:.0%}: {met(r['loss_met'])}"] for name, r in got["rows"].items()]
    if not rows:
        return []
    return [markdown_table(["FP8 against bf16", "model", "bf16 tokens/s", "FP8 tokens/s", "FP8 / bf16",
                            "speed target", f"bf16 loss (last {LOSS_WINDOW})", f"FP8 loss (last {LOSS_WINDOW})",
                            "gap", "loss target"], rows),
            "", f"{got.get('flags', ' '.join(FP8_FLAGS))} against bf16, {got['steps']} steps each on the same "
                f"batches of the repository's docs (byte ids in the models' own vocabulary); tokens/s "
                f"over the steps after the warm-up; loss: the mean of the last {LOSS_WINDOW} steps",
            ""]
