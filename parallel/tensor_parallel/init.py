"""Layout-independent initialization.

Every logical weight is drawn from a generator seeded by (seed, global name) in its full serial shape
and then sliced, so a TP shard holds exactly the rows/columns of the serial weight and a pipeline
stage holds exactly the serial layers it owns. The cost is drawing the full tensor once per rank at
startup, which is acceptable for the model sizes trained from scratch here; at very large sizes one
would draw only the shard's rows from a counter-based generator.

A tensor of more than ``CHUNK_ELEMENTS`` elements is drawn in chunks of that many, chunk k from its
own generator seeded by (seed, name, k), on up to ``torch.get_num_threads()`` threads started
through parallel/runtime/streams.py, the caller drawing its share too (torch's
sampler is serial: a 1.3B model's weights took about 13 s on one core, and every run of a
benchmark pays it before its first step). Its values depend on the name and seed only, never on the
thread count; smaller tensors are one generator's draw, as before.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from parallel.runtime import streams

CHUNK_ELEMENTS = 1 << 23   # 8M elements: larger tensors are drawn in chunks, in parallel


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def shard(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """The rank's contiguous slice of ``full`` along ``dim``, a tensor of its own (``full`` itself
    when dim is None or size is 1: the caller's fresh draw, not copied)."""
    if dim is None or size == 1:
        return full
    if full.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split over {size} ranks")
    return full.chunk(size, dim=dim)[rank].clone()


@dataclass(frozen=True)
class Initializer:
    """Draws logical weights by global name. ``std`` is the default normal std."""
    seed: int = 1234
    std: float = 0.02

    def full(self, name: str, shape: tuple[int, ...], kind: str = "normal",
             std: float | None = None) -> torch.Tensor:
        if kind == "zeros":
            return torch.zeros(shape)
        if kind == "ones":
            return torch.ones(shape)
        if kind != "normal":
            raise ValueError(f"unknown init kind {kind!r}; use normal, zeros or ones")
        return normal(self.seed, name, shape, self.std if std is None else std)

    def param(self, name: str, shape: tuple[int, ...], kind: str = "normal",
              std: float | None = None, shard_dim: int | None = None, rank: int = 0,
              size: int = 1) -> torch.nn.Parameter:
        """The logical weight ``name`` of ``shape``, or with ``shard_dim`` rank ``rank``'s slice of
        it over ``size`` ranks. A slice over more than one rank is marked ``tp_sharded`` with
        ``tp_shard_dim``, as the TP layers mark theirs, so a checkpoint saves the logical tensor
        (each TP rank its box) and the gradient norm counts every slice."""
        if shard_dim is not None and size > 1 and shape[shard_dim] % size:
            raise ValueError(f"parameter {name} {tuple(shape)}: dimension {shard_dim} of size "
                             f"{shape[shard_dim]} does not split over {size} ranks; choose a size "
                             f"divisible by {size}")
        p = torch.nn.Parameter(shard(self.full(name, shape, kind, std), shard_dim, rank, size))
        if shard_dim is not None and size > 1:
            p.tp_sharded, p.tp_shard_dim = True, shard_dim
        return p


def normal(seed: int, name: str, shape: tuple[int, ...], std: float,
           threads: int | None = None) -> torch.Tensor:
    """N(0, std^2) of ``shape`` from (seed, name): one generator's draw up to ``CHUNK_ELEMENTS``
    elements, else chunk k from (seed, f"{name}#{k}") on ``threads`` threads (default torch's
    intra-op thread count), the same values for any count."""
    numel = math.prod(shape)
    if numel <= CHUNK_ELEMENTS:
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        return torch.randn(shape, generator=gen).mul_(std)
    out = torch.empty(numel)

    def draw(k: int) -> None:
        part = out[k * CHUNK_ELEMENTS:(k + 1) * CHUNK_ELEMENTS]
        gen = torch.Generator().manual_seed(name_seed(seed, f"{name}#{k}"))
        torch.randn(part.shape, generator=gen, out=part)
        part.mul_(std)
    chunks = range(math.ceil(numel / CHUNK_ELEMENTS))
    workers = max(1, min(len(chunks), threads or torch.get_num_threads()))
    shares = [chunks[i::workers] for i in range(workers)]
    # worker threads through the stream API (the checker sees the joins), host memory only
    started = [streams.start_thread(f"init-{i}", lambda share=share: [draw(k) for k in share],
                                    "cpu", on_error=lambda exc: None)
               for i, share in enumerate(shares[1:], start=1)]
    for k in shares[0]:
        draw(k)
    for thread in started:
        thread.join()
        if thread.error is not None:
            raise thread.error
    return out.view(shape)
