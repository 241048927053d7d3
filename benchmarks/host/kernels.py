"""Time each kernel's fused path against its plain-math reference on one device.

    python -m benchmarks.host.kernels --device cpu
    python -m benchmarks.host.kernels --device cuda --dtype bf16 --seq 2048

Prints a markdown table of medians (after warm-up) and the ratio reference_time / fused_time, for the
forward pass alone and for forward + backward. A ratio above 1 means the fused path is faster. The
fused path is whatever ``kernels`` dispatches to for that device (see ``kernel_paths``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from benchmarks.common import BenchParser, at_least  # noqa: E402
from engine.config.schema import PRECISION_DTYPES as DTYPES  # noqa: E402



def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _median_ms(fn, device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cases(a, device, dtype):
    """(op name, fused fn, reference fn, input tensors) for each op at the requested sizes."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    b, n, s, d = a.batch, a.heads, a.seq, a.head_dim
    h = n * d
    cos, sin = kernels.rope_cos_sin(s, d, device=device, dtype=dtype)
    return [
        ("attention (causal)", kernels.attention, kernels.attention_reference,
         [rand(b, n, s, d), rand(b, n, s, d), rand(b, n, s, d)]),
        ("layer_norm", kernels.layer_norm, kernels.layer_norm_reference, [rand(b, s, h), rand(h), rand(h)]),
        ("rms_norm", kernels.rms_norm, kernels.rms_norm_reference, [rand(b, s, h), rand(h)]),
        ("rope", lambda x: kernels.apply_rope(x, cos, sin), lambda x: kernels.apply_rope_reference(x, cos, sin),
         [rand(b, n, s, d)]),
        ("swiglu", kernels.swiglu, kernels.swiglu_reference, [rand(b, s, a.ffn), rand(b, s, a.ffn)]),
    ]


def _forward(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def _forward_backward(fn, inputs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]

    def run():
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        for x in leaves:
            x.grad = None
    return run


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=1408, help="SwiGLU width (per half)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 keeps torch's default)")
    a = p.parse_args(argv)
    at_least(p, a, batch=1, heads=1, seq=1, head_dim=2, ffn=1, warmup=0, reps=1, threads=0)
    if a.head_dim % 2:
        p.error(f"--head-dim must be even (RoPE rotates pairs), got {a.head_dim}")

    try:
        device = torch.empty(1, device=a.device).device
    except (RuntimeError, AssertionError) as err:
        print(f"device {a.device!r} is not available in this torch build: {err}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    paths = kernels.kernel_paths(device.type)

    print(f"torch {torch.__version__}, device {device.type}, dtype {a.dtype}, threads {torch.get_num_threads()}, "
          f"b={a.batch} n={a.heads} s={a.seq} d={a.head_dim} ffn={a.ffn}, median of {a.reps} after {a.warmup} "
          f"warm-up\n")
    print("| op | fused path | fwd ref ms | fwd fused ms | fwd ratio | f+b ref ms | f+b fused ms | f+b ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, fused, ref, inputs in _cases(a, device, dtype):
        row = []
        for make in (_forward, _forward_backward):
            t_ref = _median_ms(make(ref, inputs), device, a.warmup, a.reps)
            t_fused = _median_ms(make(fused, inputs), device, a.warmup, a.reps)
            row += [f"{t_ref:.3f}", f"{t_fused:.3f}", f"{t_ref / t_fused:.2f}x"]
        op = name.split(" ")[0]
        print(f"| {name} | {paths['rope' if op == 'rope' else op]} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
