"""Layout-independent initialization.

Every logical weight is drawn from a generator seeded by (seed, global name) in its full serial shape
and then sliced, so a TP shard holds exactly the rows/columns of the serial weight and a pipeline
stage holds exactly the serial layers it owns. The cost is drawing the full tensor once per rank at
startup, which is acceptable for the model sizes trained from scratch here; at very large sizes one
would draw only the shard's rows from a counter-based generator.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def shard(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """The rank's contiguous slice of ``full`` along ``dim`` (the whole tensor when dim is None)."""
    if dim is None or size == 1:
        return full.clone()
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
        gen = torch.Generator().manual_seed(name_seed(self.seed, name))
        return torch.randn(shape, generator=gen) * (self.std if std is None else std)

    def param(self, name: str, shape: tuple[int, ...], kind: str = "normal",
              std: float | None = None, shard_dim: int | None = None, rank: int = 0,
              size: int = 1) -> torch.nn.Parameter:
        return torch.nn.Parameter(shard(self.full(name, shape, kind, std), shard_dim, rank, size))
