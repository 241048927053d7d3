"""Long context under context parallelism: activation memory per rank and tokens/s at seq 1k-8k for
cp = 1, 2, 4, next to the planner's estimate.

    python -m benchmarks.memory.long_context                          # seq 1024..8192, cp 1,2,4, ring
    python -m benchmarks.memory.long_context --cp-comm-type a2a --seq 1024,2048 --cp 1,2

A tiny Llama-style model (2 layers, h 64, 4 heads, SwiGLU, RMSNorm, RoPE, fp32) runs
one micro-batch of one sequence on each of cp gloo processes of this CPU, each holding its sequence
shard (the ring's load-balanced chunks, or Ulysses' contiguous shards).

- Activation memory: the bytes of the distinct tensors autograd saves for backward during the
  forward of the transformer layers (``torch.autograd.graph.saved_tensors_hooks``; a storage counted
  once, parameters not counted), split by the module that saved them: attention (the QKV and output
  projections, RoPE, the attention kernel), MLP, norms. The embedding, output layer and loss are
  left out (they are not what CP splits inside a layer). Target: attention + MLP per rank within
  10% of 1/cp of cp=1's.
- Planner: ``engine.plan.model.layer_activation_bytes`` of the same shape and layout (fused
  attention, this engine's fp32 and no dropout), times the layers; target: within 10% of measured.
- tokens/s: the sequence's tokens over the slowest rank's forward + backward time (median of a few
  repeats). The cp processes share this machine's cores, so the figure shows overheads, not scaling.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import BenchParser, at_least, parse_int_list  # noqa: E402
from engine.plan.model import Layout, ModelShape  # noqa: E402
from engine.plan.memory import layer_activation_bytes  # noqa: E402
from models import GPTChunk, GPTConfig, LayerContext  # noqa: E402
from models.layers import Norm, ParallelAttention, ParallelMLP  # noqa: E402
from parallel.context_parallel import load_balanced, shard_index  # noqa: E402
from parallel.context_parallel.sharding import check_shardable  # noqa: E402
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState  # noqa: E402
from parallel.tensor_parallel import Initializer  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402

PARTS = ("attention", "mlp", "norm")
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, block="llama")


class SavedActivations:
    """Bytes of the distinct storages autograd saves while inside, by the innermost labelled module
    (``labels``: module class -> name) that was running; parameters excluded."""

    def __init__(self, model: torch.nn.Module, labels: dict[type, str]):
        self.bytes: Counter = Counter()
        self._seen: set[int] = set()
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._stack: list[str] = []
        self._handles = []
        for m in model.modules():
            name = next((v for k, v in labels.items() if isinstance(m, k)), None)
            if name is not None:
                self._handles.append(m.register_forward_pre_hook(self._enter(name)))
                self._handles.append(m.register_forward_hook(self._leave))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _enter(self, name: str):
        def hook(module, args) -> None:
            self._stack.append(name)
        return hook

    def _leave(self, module, args, out) -> None:
        self._stack.pop()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if self._stack and ptr not in self._seen and ptr not in self._params:
            self._seen.add(ptr)
            self.bytes[self._stack[-1]] += storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        return False


def build(ps: ParallelState, seq: int, comm_type: str) -> GPTChunk:
    cfg = GPTConfig(seq_length=seq, **MODEL)
    ctx = LayerContext(Initializer(0, cfg.init_std), cp_comm_type=comm_type)
    return GPTChunk(cfg, ps, ctx, range(cfg.num_layers))


def shard_tokens(seq: int, cp: int, rank: int, comm_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    sample = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
    idx = torch.tensor(shard_index(seq, cp, rank, load_balanced(comm_type)))
    return sample[:, :-1].index_select(1, idx), sample[:, 1:].index_select(1, idx)


def measure(ps: ParallelState, seq: int, comm_type: str, repeats: int) -> dict:
    """Saved bytes by part and the slowest rank's forward + backward seconds (median)."""
    model = build(ps, seq, comm_type)
    tokens, labels = shard_tokens(seq, ps.cp_size, ps.cp_rank, comm_type)
    with SavedActivations(model.layers, {ParallelAttention: "attention", ParallelMLP: "mlp", Norm: "norm"}) as saved:
        loss = model(tokens, labels).mean()
    loss.backward()
    times = []
    for _ in range(repeats):
        ps.cp_group.barrier()
        t0 = time.perf_counter()
        model(tokens, labels).mean().backward()
        dt = torch.tensor([time.perf_counter() - t0])
        ps.cp_group.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    return {"bytes": dict(saved.bytes), "seconds": statistics.median(times)}


def planner_bytes(seq: int, cp: int) -> float:
    """The planner's activation bytes of the model's layers per micro-batch on one rank."""
    shape = ModelShape(MODEL["num_layers"], MODEL["hidden_size"], MODEL["num_attention_heads"],
                       MODEL["vocab_size"], seq, 1, block="llama", fused_attention=True,
                       activation_bytes=4, dropout=False)
    layout = Layout(tp=1, pp=1, dp=1, cp=cp)
    return MODEL["num_layers"] * layer_activation_bytes(shape, layout)


def _worker(rank, world, port, seqs, comm_type, repeats, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # one core per rank: several threads per rank on a shared machine stall
    ps = ParallelState.initialize(RankGrid(cp=world), torch.device("cpu"), "gloo",
                                  LaunchEnv.from_env(), timeout_s=600)
    results = {seq: measure(ps, seq, comm_type, repeats) for seq in seqs}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"cp{world}.pt"))
    ps.destroy()


def run(cp: int, seqs: list[int], comm_type: str, repeats: int, out_dir: str) -> dict:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(cp, port, seqs, comm_type, repeats, out_dir), nprocs=cp,
                       start_method="spawn")
    return torch.load(os.path.join(out_dir, f"cp{cp}.pt"))


def table(results: dict[int, dict], seqs: list[int]) -> str:
    """One row per (seq, cp). ``attn+MLP vs 1/cp``: attention + MLP bytes over cp=1's divided by cp
    (target within 10% of 1); ``planner / measured``: the planner's layer activations over the
    measured layers' total; ``planner cp term``: the planner's own cp=1 -> cp ratio applied to the
    measured cp=1 total, over the measured total at cp."""
    rows = ["| seq | cp | attention MiB | MLP MiB | norms MiB | attn+MLP vs 1/cp | layers MiB | "
            "planner MiB | planner / measured | planner cp term / measured | tokens/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    mib, first = 2 ** 20, min(results)
    for seq in seqs:
        base = results[first][seq]["bytes"]
        base_am = (base.get("attention", 0) + base.get("mlp", 0)) * first
        base_total = sum(base.get(p, 0) for p in PARTS)
        for cp, by_seq in sorted(results.items()):
            r = by_seq[seq]
            b = r["bytes"]
            am = b.get("attention", 0) + b.get("mlp", 0)
            total = sum(b.get(p, 0) for p in PARTS)
            plan = planner_bytes(seq, cp)
            term = base_total * plan / planner_bytes(seq, first)
            rows.append(f"| {seq} | {cp} | {b.get('attention', 0) / mib:.3f} | {b.get('mlp', 0) / mib:.3f} "
                        f"| {b.get('norm', 0) / mib:.3f} | {am * cp / base_am:.3f} | {total / mib:.3f} | "
                        f"{plan / mib:.3f} | {plan / total:.3f} | {term / total:.3f} | "
                        f"{seq / r['seconds']:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = BenchParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="1024,2048,4096,8192")
    p.add_argument("--cp", default="1,2,4")
    p.add_argument("--cp-comm-type", default="p2p", choices=("p2p", "a2a"))
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    at_least(p, a, repeats=1)
    try:
        seqs, cps = parse_int_list(a.seq, "--seq"), parse_int_list(a.cp, "--cp")
        for cp in cps:
            if a.cp_comm_type == "a2a" and MODEL["num_attention_heads"] % cp:
                raise ValueError(f"--cp {cp} does not divide the model's "
                                 f"{MODEL['num_attention_heads']} heads (--cp-comm-type a2a)")
            for seq in seqs:
                check_shardable(seq, cp, load_balanced(a.cp_comm_type))
    except ValueError as exc:
        p.error(str(exc))
    import tempfile
    with tempfile.TemporaryDirectory() as out_dir:
        results = {cp: run(cp, seqs, a.cp_comm_type, a.repeats, out_dir) for cp in cps}
    print(f"context parallelism ({a.cp_comm_type}), {MODEL}, fp32, one sequence per micro-batch; "
          f"activation bytes per rank saved by the layers' forward\n")
    print(table(results, seqs))


if __name__ == "__main__":
    main()
