"""Count tensor-parallel communication per transformer layer per step, next to the analytic count.

    python -m benchmarks.communication.tp_comm                       # tp=2 and tp=4 on gloo (CPU processes)
    python -m benchmarks.communication.tp_comm --tp 2 --batch 4 --seq 256 --hidden 512

For each tp, with and without sequence parallelism and for both block flavours, a tiny GPT runs one
forward and one backward while torch.distributed's collectives are wrapped to record the op and the
size of the full (unsharded) buffer each one moves. Running 1 and 2 layers and subtracting gives the
per-layer cost; what remains is the embedding, output layer and loss ("outside layers").

Analytic count per layer, S = b * s * h * bytes per element:
- without SP: forward 2 all-reduces of S (attention output and MLP output projections), backward 2
  all-reduces of S (gradients of the inputs of the QKV and first MLP projections);
- with SP: each all-reduce becomes a reduce-scatter and an all-gather of the same S, in both passes.
On a ring an all-reduce puts 2(n-1)/n * S on each rank's link, an all-gather or a reduce-scatter
(n-1)/n * S, so SP moves the same bytes while keeping activations outside attention/MLP at s/tp.
Prints a markdown table; "match" says whether the measured per-layer collectives equal the analytic.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import GPTChunk, GPTConfig, LayerContext  # noqa: E402
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState  # noqa: E402
from parallel.tensor_parallel import Initializer  # noqa: E402
from parallel.grid.topology import RankGrid  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CollectiveCounter:
    """Wraps torch.distributed's collectives (a benchmark-only patch) and records, per op, how many
    calls and the bytes of the full buffer: the reduced tensor for all-reduce, the gathered output
    for all-gather, the unscattered input for reduce-scatter."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self._orig = {}

    def _record(self, op: str, nbytes: int) -> None:
        self.counts[op] += 1
        self.bytes[op] += nbytes

    def __enter__(self):
        sizes = {
            "all_reduce": lambda t, *a, **k: _nbytes(t),
            "all_gather": lambda outs, t, *a, **k: sum(_nbytes(o) for o in outs),
            "all_gather_into_tensor": lambda out, t, *a, **k: _nbytes(out),
            "all_gather_single": lambda out, t, *a, **k: _nbytes(out),
            "reduce_scatter": lambda out, ins, *a, **k: sum(_nbytes(i) for i in ins),
            "reduce_scatter_tensor": lambda out, t, *a, **k: _nbytes(t),
            "reduce_scatter_single": lambda out, t, *a, **k: _nbytes(t),
        }
        for name, size in sizes.items():
            orig = getattr(dist, name)
            self._orig[name] = orig
            op = name.replace("_into_tensor", "").replace("_tensor", "").replace("_single", "")

            def wrapped(*args, _orig=orig, _size=size, _op=op, **kwargs):
                self._record(_op, _size(*args, **kwargs))
                return _orig(*args, **kwargs)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)

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
    with CollectiveCounter() as counter:
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        fwd = counter.take()
        loss.backward()
        bwd = counter.take()
    return {"forward": fwd, "backward": bwd}


def analytic(sp: bool, n: int, S: int) -> dict:
    per_pass = ({"all_gather": 2, "reduce_scatter": 2} if sp else {"all_reduce": 2})
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
            want = analytic(sp, n, S)
            for phase in ("forward", "backward"):
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
