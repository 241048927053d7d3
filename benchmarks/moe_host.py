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
layers of a round alike), beside the median times.

    python -m benchmarks.moe_host [--rounds 15] [--iters 40]
"""
from __future__ import annotations

import argparse
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


def _step_fn(module, moe: bool):
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def step():
        module(x).sum().backward()
        if moe:
            module.mlp.records.clear()
    return step


def _timed(step, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def measure(block: str, rounds: int = 15, iters: int = 40) -> dict:
    """{"dense_us", "moe_us", "ratio", "dense_ops", "moe_ops"} for one block kind."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {moe: _step_fn(layer(block, moe), moe) for moe in (False, True)}
        ops = {}
        for moe, step in steps.items():
            for _ in range(5):
                step()                       # first calls: allocations, probes
            with _OpCount() as count:
                step()
            ops[moe] = count.ops
        times, ratios = {False: [], True: []}, []
        for _ in range(rounds):
            pair = {moe: _timed(steps[moe], iters) for moe in (False, True)}
            for moe, t in pair.items():
                times[moe].append(t)
            ratios.append(pair[True] / pair[False])
    finally:
        torch.set_num_threads(threads)
    return {"block": block, "dense_us": 1e6 * statistics.median(times[False]),
            "moe_us": 1e6 * statistics.median(times[True]), "ratio": statistics.median(ratios),
            "dense_ops": ops[False], "moe_ops": ops[True]}


def table(rows: list[dict]) -> str:
    from benchmarks.common import markdown_table
    return markdown_table(
        ["block", "dense layer (us)", "MoE layer (us)", "MoE / dense (median of rounds)",
         "aten ops dense", "aten ops MoE"],
        [[r["block"], f"{r['dense_us']:.0f}", f"{r['moe_us']:.0f}", f"{r['ratio']:.2f}",
          str(r["dense_ops"]), str(r["moe_ops"])] for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args(argv)
    rows = [measure(block, args.rounds, args.iters) for block in ("gpt2", "llama")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
