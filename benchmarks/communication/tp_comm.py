"""Count tensor-parallel communication per transformer layer per step, next to the analytic count.

    python -m benchmarks.communication.tp_comm                       # tp=2 and tp=4 on gloo (CPU processes)
    python -m benchmarks.communication.tp_comm --tp 2 --batch 4 --seq 256 --hidden 512

For each tp, with and without sequence parallelism and for both block flavours, a tiny GPT runs one
forward and one backward while every collective of the tensor-parallel group is recorded with the op
and the size of the full (unsharded) buffer it moves. Running 1 and 2 layers and subtracting gives the
per-layer cost; what remains is the embedding, output layer and loss ("outside layers").

Analytic count per layer, S = b * s * h * bytes per element:
- without SP: forward 2 all-reduces of S (attention output and MLP output projections), backward 2
  all-reduces of S (gradients of the inputs of the QKV and first MLP projections);
- with SP, forward: 2 all-gathers of S (the inputs of the QKV and first MLP projections) and 2
  reduce-scatters of S (the outputs of the attention output and second MLP projections);
- with SP, backward: 2 reduce-scatters of S (the gradients of the gathered inputs) and 4
  all-gathers of S: the 2 of the output gradients, and 2 more because the column layers keep only
  their s/tp input shard for the weight gradient and gather it again (Megatron-style).
On a ring an all-reduce puts 2(n-1)/n * S on each rank's link, an all-gather or a reduce-scatter
(n-1)/n * S. SP therefore moves the same bytes as the all-reduces in forward, and 1.5x their bytes in
backward (6 (n-1)/n * S against 4 (n-1)/n * S), in exchange for activations at s/tp outside
attention/MLP and no full-sequence input kept for the weight gradient.
The collectives are counted through the communication layer's observers (``ps.comm.observers``).
Prints a markdown table; "match" says whether the measured per-layer collectives equal the analytic.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import GPTChunk, GPTConfig, LayerContext  # noqa: E402
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState  # noqa: E402
from parallel.tensor_parallel import Initializer  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")


class CollectiveCounter:
    """Records, per op, how many collectives the tensor-parallel group issued and the bytes of the
    full buffer each one moves (the reduced tensor for all-reduce, the gathered output for
    all-gather, the unscattered input for reduce-scatter). It listens on the communication layer's
    observers (``ps.comm.observers``, one ``CommEvent`` per call), so it sees exactly what the
    engine issues, whichever torch.distributed function a ``CommGroup`` calls underneath."""

    def __init__(self, ps: ParallelState):
        self.ps = ps
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def _observe(self, event) -> None:
        if event.group != "tp" or event.op not in OPS:
            return
        size = len(event.ranks)
        # a CommEvent's payload is what this rank hands over: an all-gather's own shard
        full = event.payload_bytes * size if event.op == "all_gather" else event.payload_bytes
        self.counts[event.op] += 1
        self.bytes[event.op] += full

    def __enter__(self):
        self.ps.comm.observers.append(self._observe)
        return self

    def __exit__(self, *exc):
        self.ps.comm.observers.remove(self._observe)
        return False

    def take(self) -> tuple[Counter, Counter]:
        out = (self.counts.copy(), self.bytes.copy())
        self.counts.clear()
        self.bytes.clear()
        return out


def measure(ps: ParallelState, block: str, sp: bool, layers: int, a) -> dict:
    cfg = GPTConfig(num_layers=layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                    seq_length=a.seq, vocab_size=a.vocab, block=block)
    model = GPTChunk(cfg, ps, LayerContext(Initializer(0), sequence_parallel=sp), range(layers))
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    with CollectiveCounter(ps) as counter:
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        fwd = counter.take()
        loss.backward()
        bwd = counter.take()
    return {"forward": fwd, "backward": bwd}


def analytic(sp: bool, phase: str, n: int, S: int) -> dict:
    """Per layer and pass: see the module docstring (SP backward re-gathers the column layers'
    input, hence 4 all-gathers)."""
    if not sp:
        per_pass = {"all_reduce": 2}
    elif phase == "forward":
        per_pass = {"all_gather": 2, "reduce_scatter": 2}
    else:
        per_pass = {"all_gather": 4, "reduce_scatter": 2}
    nbytes = Counter({op: c * S for op, c in per_pass.items()})
    return {"counts": Counter(per_pass), "bytes": nbytes, "wire": wire_bytes(nbytes, n)}


def _fmt_counts(c: Counter) -> str:
    return ", ".join(f"{c[op]} {op}" for op in OPS if c[op]) or "none"


def _fmt_bytes(c: Counter) -> str:
    return ", ".join(f"{c[op] / 2**20:.3f}" for op in OPS if c[op]) or "0"


def wire_bytes(nbytes: Counter, n: int) -> float:
    """Bytes each rank sends on a ring: 2(n-1)/n of the buffer for all-reduce, (n-1)/n otherwise."""
    return sum(nbytes[op] * (2 if op == "all_reduce" else 1) * (n - 1) / n for op in OPS)


def rows_for(ps: ParallelState, a) -> list[str]:
    n = ps.tp_size
    S = a.batch * a.seq * a.hidden * 4  # fp32
    rows = []
    for sp in (False, True):
        for block in ("gpt2", "llama"):
            one, two = measure(ps, block, sp, 1, a), measure(ps, block, sp, 2, a)
            for phase in ("forward", "backward"):
                want = analytic(sp, phase, n, S)
                counts = two[phase][0] - one[phase][0]
                nbytes = two[phase][1] - one[phase][1]
                outside_c = one[phase][0] - counts
                ok = counts == want["counts"] and nbytes == want["bytes"]
                rows.append(
                    f"| {n} | {'yes' if sp else 'no'} | {block} | {phase} | {_fmt_counts(counts)} | "
                    f"{_fmt_counts(want['counts'])} | {_fmt_bytes(nbytes)} | "
                    f"{wire_bytes(nbytes, n) / 2**20:.3f} | "
                    f"{want['wire'] / 2**20:.3f} | {_fmt_counts(outside_c)} | "
                    f"{'yes' if ok else 'NO'} |")
    return rows


HEADER = ("| tp | SP | block | pass | per layer: measured | per layer: analytic | buffer MiB "
          "(per op) | wire MiB/rank | analytic wire MiB/rank | outside layers | match |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def _worker(rank: int, world: int, port: int, a) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    ps = ParallelState.initialize(RankGrid(tp=world), torch.device("cpu"), "gloo",
                                  LaunchEnv.from_env(), timeout_s=120)
    rows = rows_for(ps, a)
    if rank == 0:
        print("\n".join(rows), flush=True)
    ps.destroy()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1000)
    a = p.parse_args(argv)
    S = a.batch * a.seq * a.hidden * 4
    print(f"b={a.batch} s={a.seq} h={a.hidden} fp32: S = b*s*h*4 = {S / 2**20:.3f} MiB; "
          f"buffer MiB per op in the order all_reduce, all_gather, reduce_scatter\n")
    print(HEADER, flush=True)
    for tp in a.tp:
        mp.start_processes(_worker, args=(tp, _free_port(), a), nprocs=tp, start_method="spawn")


if __name__ == "__main__":
    main()
