"""Host time of one MoE layer against one dense layer of the same active FLOPs, on this CPU.

A GPU runs an MoE step at its own speed only while the host queues kernels faster than the device
runs them; the host's cost of a layer (Python, the dispatcher, autograd, one launch per op) is
what decides that. This measures it where it can be measured without a device: a transformer
layer's forward and backward on the CPU at a size where the arithmetic is small next to the
per-op cost (micro-batch 1, 32 tokens, hidden 64, one intra-op thread), MoE (8 experts of width
4h, top-2, the aux loss) against dense (ffn 8h: the same active FLOPs), gpt2 and llama blocks. On
this CPU the time still holds the kernels' own work (the grouped GEMM's CPU kernel among them),
so it bounds the host time from above; the aten ops dispatched per layer (forward and backward,
counted by a dispatch mode) are the count a device would launch.

The two layers are timed in alternation, ``rounds`` times ``iters`` calls each, and each round's
ratio MoE / dense is kept: the figure is the median ratio (a shared machine's load moves both
layers of a round alike), beside the median times. Each round is timed twice over: wall-clock
(``time.perf_counter``) and the CPU time of this thread (``time.thread_time``: the layer's own
work, which other processes' load on a shared machine does not stretch; the backward of a CPU
tensor runs on the calling thread, and one intra-op thread is set).

``--ablate`` adds what-ifs, timed in the same rounds: the MoE layer without its balancing loss,
and with the grouped GEMM run as ONE matmul of the same FLOPs (wrong values, timing only): what
the layer costs where the grouped GEMM is one kernel, as on a GPU, instead of the CPU kernel's
loop of one matrix product per expert.

``--compiled`` adds both layers under ``torch.compile`` (Inductor, as ``--compile`` runs them; the
MoE block compiles with no graph break at ep 1): what the host pays per layer when the graph's
kernels replace the eager ops. Their aten-op columns say n/a: under a dispatch mode (the counter)
the compiled graph is not entered, so a count would be the eager one.

    python -m benchmarks.host.moe_layer [--rounds 15] [--iters 40] [--ablate] [--compiled]
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN, TOKENS, EXPERTS, TOPK = 64, 32, 8, 2


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def layer(block: str, moe: bool):
    """One transformer layer (the engine's block) of the benchmark's size."""
    from models import LayerContext, build_chunks
    from models.config import GPTConfig
    from parallel.grid.state import ParallelState
    from parallel.tensor_parallel import Initializer
    h = HIDDEN
    shape = (dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=4 * h,
                  moe_aux_loss_coeff=0.01) if moe else dict(ffn_hidden_size=TOPK * 4 * h))
    cfg = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=4, seq_length=TOKENS,
                    vocab_size=64, block=block, **shape)
    return build_chunks(cfg, ParallelState.serial(), LayerContext(Initializer(1, 0.02)),
                        [range(1)], [0], 1)[0].layers[0]


def _step_fn(module, moe: bool, compiled: bool = False):
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(0), requires_grad=True)
    run = torch.compile(module, backend="inductor") if compiled else module

    def step():
        run(x).sum().backward()
        if moe:
            module.mlp.reset_totals()
    return step


def _one_matmul(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM's shapes from ONE matmul of its FLOPs (values wrong: timing only)."""
    if b.dim() == 3:                                                  # (n, k) x (G, k, out)
        return a @ b[0]
    return (a @ b).unsqueeze(0).expand(offs.shape[0], -1, -1).contiguous()  # (G, out, k)


def _with_one_matmul(step):
    grouped = importlib.import_module("kernels.grouped_experts")

    def wrapped():
        real, grouped._gmm = grouped._gmm, _one_matmul
        try:
            step()
        finally:
            grouped._gmm = real
    return wrapped


def _timed(step, iters: int) -> tuple[float, float]:
    """(wall, CPU time of this thread) per call, seconds."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        step()
    return (time.perf_counter() - wall) / iters, (time.thread_time() - cpu) / iters


def _steps(block: str, ablate: bool, compiled: bool = False) -> dict:
    steps = {"dense": _step_fn(layer(block, False), False, compiled),
             "moe": _step_fn(layer(block, True), True, compiled)}
    if ablate:
        no_loss = layer(block, True)
        no_loss.mlp.aux_coeff = 0.0
        steps["moe, no balancing loss"] = _step_fn(no_loss, True)
        steps["moe, grouped GEMM as one matmul"] = _with_one_matmul(steps["moe"])
    return steps


def measure(block: str, rounds: int = 15, iters: int = 40, ablate: bool = False,
            compiled: bool = False) -> dict:
    """{"dense_us", "moe_us", "ratio", "cpu_ratio", "dense_ops", "moe_ops"} for one block kind
    (with ``ablate``, "ablations": {what-if: median CPU-time ratio to dense}; ``compiled``: both
    layers under torch.compile, Inductor, as ``--compile`` runs them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = _steps(block, ablate, compiled)
        ops = {}
        for name, step in steps.items():
            for _ in range(5):
                step()                       # first calls: allocations, probes, compilation
            if compiled:   # (under a dispatch mode the compiled graph is not entered: no count)
                ops[name] = None
                continue
            with _OpCount() as count:
                step()
            ops[name] = count.ops
        wall, cpu = {name: [] for name in steps}, {name: [] for name in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                w, c = _timed(step, iters)
                wall[name].append(w)
                cpu[name].append(c)
    finally:
        torch.set_num_threads(threads)

    def ratio(times, name):
        return statistics.median(a / b for a, b in zip(times[name], times["dense"]))
    return {"block": block + (" (compiled)" if compiled else ""), "dense_us": 1e6 * statistics.median(wall["dense"]),
            "moe_us": 1e6 * statistics.median(wall["moe"]), "ratio": ratio(wall, "moe"),
            "cpu_ratio": ratio(cpu, "moe"), "dense_ops": ops["dense"], "moe_ops": ops["moe"],
            **({"ablations": {n: ratio(cpu, n) for n in steps if n not in ("dense", "moe")}}
               if ablate else {})}


def table(rows: list[dict]) -> str:
    from benchmarks.common import markdown_table
    out = markdown_table(
        ["block", "dense layer (us)", "MoE layer (us)", "MoE / dense, wall (median of rounds)",
         "MoE / dense, CPU time (median of rounds)", "aten ops dense", "aten ops MoE"],
        [[r["block"], f"{r['dense_us']:.0f}", f"{r['moe_us']:.0f}", f"{r['ratio']:.2f}",
          f"{r['cpu_ratio']:.2f}", *("n/a" if n is None else str(n)
                                     for n in (r["dense_ops"], r["moe_ops"]))] for r in rows])
    ablated = [r for r in rows if "ablations" in r]
    if ablated:
        names = list(ablated[0]["ablations"])
        out += "\n\n" + markdown_table(
            ["block", "MoE / dense, CPU time", *[f"{n} / dense" for n in names]],
            [[r["block"], f"{r['cpu_ratio']:.2f}", *[f"{r['ablations'][n]:.2f}" for n in names]]
             for r in ablated])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--ablate", action="store_true",
                   help="also time the MoE layer without its balancing loss and with the grouped "
                        "GEMM as one matmul of the same FLOPs (timing only)")
    p.add_argument("--compiled", action="store_true",
                   help="also time both layers under torch.compile (Inductor), as --compile runs "
                        "them: the graph's kernels in place of the eager ops")
    args = p.parse_args(argv)
    rows = [measure(block, args.rounds, args.iters, args.ablate) for block in ("gpt2", "llama")]
    if args.compiled:
        rows += [measure(block, args.rounds, args.iters, compiled=True) for block in ("gpt2", "llama")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
