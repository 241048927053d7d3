"""Accelerator check, ready to run on a CUDA or Ascend NPU machine (``make device-check``).

    python -m benchmarks.device_check                 # kernels, then the 1.3B GPT eager and compiled
    python -m benchmarks.device_check --steps 20 --skip-compile

1. Kernels: every op's device path (``kernels`` dispatches on the tensor's device: npu_fusion_attention
   / SDPA, npu_rms_norm, npu_rotary_mul, npu_swiglu, ...) against its plain-math reference on the
   same bf16 inputs, forward and backward (causal attention, grouped-query attention and packed
   documents included); the reference runs in fp32.
2. Training: a single-device GPT of about 1.3B parameters (24 layers, hidden 2048, 16 heads, seq
   2048, bf16, mock data) for ``--steps`` steps, once eager and once with ``--compile``, each a
   separate ``python -m engine.train`` process writing its metrics file; the table gives tokens/s,
   TFLOP/s per device, MFU and HFU as totals over the steps after ``--warmup`` (compilation happens
   in the warm-up steps), and the peak memory.

On a machine without an accelerator it says so and exits 0: there is nothing to check. The whole
check fits in about 8 minutes on one A100/H100-class device. Paste the printed tables into
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kernels  # noqa: E402
from benchmarks.common import markdown_table  # noqa: E402
from engine.device.runtime import detect_device_type, setup_device  # noqa: E402
from engine.observe.metrics import summarize_run  # noqa: E402

MODEL = {"num-layers": 24, "hidden-size": 2048, "num-attention-heads": 16, "seq-length": 2048,
         "vocab-size": 51200}
# (forward, gradient) tolerances on bf16 inputs against the fp32 reference
TOLERANCE = {torch.bfloat16: (3e-2, 6e-2), torch.float16: (5e-3, 1e-2), torch.float32: (1e-4, 1e-4)}


# ---- kernels ---------------------------------------------------------------------------------

def kernel_cases(device: torch.device, dtype: torch.dtype, seq: int = 512):
    """(name, device-path fn, reference fn, inputs): the ops at a training-like size."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    b, n, d, ffn = 2, 8, 64, 1408
    h = n * d
    cos, sin = kernels.rope_cos_sin(seq, d, device=device, dtype=dtype)
    docs = torch.zeros(b, seq, dtype=torch.int32)
    docs[:, seq // 3:] = 1
    docs[1, 2 * seq // 3:] = 2
    docs = docs.to(device)
    return [
        ("attention causal", kernels.attention, kernels.attention_reference,
         [rand(b, n, seq, d), rand(b, n, seq, d), rand(b, n, seq, d)]),
        ("attention GQA (8 q / 2 kv heads)", kernels.attention, kernels.attention_reference,
         [rand(b, n, seq, d), rand(b, 2, seq, d), rand(b, 2, seq, d)]),
        ("attention packed documents",
         lambda q, k, v: kernels.attention(q, k, v, document_ids=docs),
         lambda q, k, v: kernels.attention_reference(q, k, v, document_ids=docs),
         [rand(b, n, seq, d), rand(b, n, seq, d), rand(b, n, seq, d)]),
        ("layer_norm", kernels.layer_norm, kernels.layer_norm_reference,
         [rand(b, seq, h), rand(h), rand(h)]),
        ("rms_norm", kernels.rms_norm, kernels.rms_norm_reference, [rand(b, seq, h), rand(h)]),
        ("rope", lambda x: kernels.apply_rope(x, cos, sin),
         lambda x: kernels.apply_rope_reference(x, cos, sin), [rand(b, n, seq, d)]),
        ("swiglu", kernels.swiglu, kernels.swiglu_reference, [rand(b, seq, ffn), rand(b, seq, ffn)]),
    ]


def _run(fn, inputs, up):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(up.to(out.dtype))
    return out.detach().float(), [x.grad.float() for x in leaves]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |b|)"""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1.0))


def check_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  seq: int = 512) -> list[dict]:
    """Each case's forward and gradient error of the device path against the reference."""
    fwd_tol, grad_tol = TOLERANCE[dtype]
    rows = []
    for name, fused, ref, inputs in kernel_cases(device, dtype, seq):
        with torch.no_grad():
            shape = fused(*inputs).shape
        up = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
        out, grads = _run(fused, inputs, up)
        ref_out, ref_grads = _run(ref, [x.float() for x in inputs], up)
        fwd = _err(out, ref_out)
        grad = max(_err(a, b) for a, b in zip(grads, ref_grads))
        rows.append({"op": name, "forward": fwd, "gradient": grad,
                     "ok": fwd <= fwd_tol and grad <= grad_tol})
    return rows


# ---- training --------------------------------------------------------------------------------

def train_argv(kind: str, steps: int, metrics: str, run_dir: str, compile_: bool,
               micro_batch: int = 4, global_batch: int = 16, model: dict | None = None,
               precision: str = "bf16") -> list[str]:
    argv = ["--mock-data", "--device", kind, "--precision", precision, "--no-progress",
            "--train-iters", str(steps), "--lr-warmup-iters", "2",
            "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
            "--metrics-file", metrics, "--run-dir", run_dir]
    for key, value in (model or MODEL).items():
        argv += [f"--{key}", str(value)]
    return argv + (["--compile"] if compile_ else [])


def run_training(kind: str, steps: int, warmup: int, out: Path, compile_: bool,
                 timeout_s: float, micro_batch: int = 4, global_batch: int = 16,
                 model: dict | None = None, precision: str = "bf16") -> dict:
    """One ``python -m engine.train`` process; its metrics summarised (totals after warm-up)."""
    tag = "compile" if compile_ else "eager"
    metrics = out / f"{tag}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "engine.train",
           *train_argv(kind, steps, str(metrics), str(out / tag), compile_, micro_batch,
                       global_batch, model, precision)]
    start = time.monotonic()
    with open(out / f"{tag}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    if proc.returncode != 0:
        tail = (out / f"{tag}.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"{tag} run exited with {proc.returncode}:\n" + "\n".join(tail))
    from benchmarks.common import read_jsonl
    summary = summarize_run(read_jsonl(metrics), warmup)
    return {"run": tag, "wall_s": time.monotonic() - start, **summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the totals")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--out", default="runs/device_check")
    p.add_argument("--micro-batch-size", type=int, default=4, help="lower it on a 40 GB device")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per training run")
    a = p.parse_args(argv)
    kind = detect_device_type("auto")
    if kind == "cpu":
        print("device_check: no accelerator (CUDA or Ascend NPU) found: nothing to check")
        return 0
    dev = setup_device(kind, 0)
    device = dev.device
    print(f"device_check: {kind} ({dev.name}), torch {torch.__version__}\n")
    rows = check_kernels(device)
    paths = kernels.kernel_paths(kind)
    print(markdown_table(["op", "device path", "forward err", "gradient err", "within tolerance"],
                         [[r["op"], paths.get(r["op"].split(" ")[0], "-"), f"{r['forward']:.2e}",
                           f"{r['gradient']:.2e}", "yes" if r["ok"] else "NO"] for r in rows]))
    failed = [r["op"] for r in rows if not r["ok"]]
    print(f"\nerrors: max |device - reference| / max(1, max |reference|); bf16 tolerance "
          f"{TOLERANCE[torch.bfloat16]}\n")
    if a.skip_training:
        return 1 if failed else 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    batch = (a.micro_batch_size, a.global_batch_size)
    runs = [run_training(kind, a.steps, a.warmup, out, False, a.timeout_s, *batch)]
    if not a.skip_compile:
        runs.append(run_training(kind, a.steps, a.warmup, out, True, a.timeout_s, *batch))
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    print(markdown_table(
        ["run", "tokens/s", "TFLOP/s per device (model)", "MFU", "HFU", "step time (s)",
         "peak memory (GiB)", "wall (s)"],
        [[r["run"], f"{r['tokens_per_s']:.0f}", f"{r['model_tflops_per_device']:.1f}", pct(r["mfu"]),
          pct(r["hfu"]), f"{r['step_time_s']:.3f}", f"{(r['peak_memory_bytes'] or 0) / 2**30:.1f}",
          f"{r['wall_s']:.0f}"] for r in runs]))
    print(f"\nGPT 1.3B ({', '.join(f'{k} {v}' for k, v in MODEL.items())}), bf16, micro-batch "
          f"{a.micro_batch_size}, global batch {a.global_batch_size}; totals over steps {a.warmup + 1}..{a.steps} ({a.warmup} warm-up steps "
          f"left out); peaks are the dense bf16 ones of engine/plan/hardware.py.")
    if failed:
        print(f"device_check: kernels outside tolerance: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
