"""Model-parallel random streams for dropout: split regions differ per TP rank, replicated agree.

Under tensor parallelism a dropout mask must be drawn independently where the ranks hold different
parts of the work, and identically where they hold copies of the same activation:

- ``split`` regions, work divided over TP ranks: the attention probabilities (each rank holds its
  own heads), a column-parallel output, and under sequence (or context) parallelism every
  activation of a sequence shard. Each TP rank draws its own stream.
- ``replicated`` regions, the same activation on every TP rank: the embedding output and the
  residual-branch outputs without sequence parallelism. Every TP rank draws the same stream, so
  the copies stay equal.

One ``RNGTracker`` per model chunk holds one generator state per region; ``tracker.fork(region)``
swaps the device's default generator to that state for the body (dropout, SDPA and
npu_fusion_attention all draw from the default generator) and back afterwards. Recomputation
(``torch.utils.checkpoint``) replays the same masks through ``tracker.checkpoint_context``, which
restores the region states the original forward started from. The process's default generator is
seeded as a ``replicated`` stream of its own ("default"), for dropout a block draws outside any
region.

Seeds: ``stream_seed`` numbers every stream of a run in mixed radix over the grid sizes, region
slowest and TP rank fastest, appends that number to the run's seed (``seed * streams + index``) and
scrambles the result with a bijection of 64-bit integers; two different (seed, region, coordinates,
chunk) never share a seed. Example, tp=2 pp=2 dp=1 vp=1 cp=1: 3 regions x 2 x 2 = 12 streams per
seed; region split (2), dp 0, pp 1, chunk 0, cp 0, tp 1 -> index ((((2*1 + 0)*2 + 1)*1 + 0)*1 + 0)*2
+ 1 = 11, and with seed 5 the key is 5 * 12 + 11 = 71 (then scrambled). A context-parallel
coordinate is one more digit (cp, default 0).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

REGIONS = ("default", "replicated", "split")
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit integers (distinct inputs, distinct outputs)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class StreamGrid:
    """The sizes of the coordinates that tell streams apart."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1  # model chunks per rank
    cp: int = 1

    @property
    def streams(self) -> int:
        return len(REGIONS) * self.dp * self.pp * self.vp * self.cp * self.tp


def stream_index(region: str, grid: StreamGrid, tp: int = 0, pp: int = 0, dp: int = 0,
                 chunk: int = 0, cp: int = 0) -> int:
    """The stream's number in [0, grid.streams): mixed radix (region, dp, pp, chunk, cp, tp)."""
    if region not in REGIONS:
        raise ValueError(f"unknown random region {region!r}; use one of {REGIONS}")
    index = REGIONS.index(region)
    for value, size, name in ((dp, grid.dp, "dp"), (pp, grid.pp, "pp"), (chunk, grid.vp, "chunk"),
                              (cp, grid.cp, "cp"), (tp, grid.tp, "tp")):
        if not 0 <= value < size:
            raise ValueError(f"stream_index: {name} coordinate {value} outside [0, {size})")
        index = index * size + value
    return index


def stream_seed(seed: int, region: str, grid: StreamGrid, tp: int = 0, pp: int = 0, dp: int = 0,
                chunk: int = 0, cp: int = 0) -> int:
    """The generator seed of one stream; injective in (seed, region, coordinates, chunk)."""
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    key = seed * grid.streams + stream_index(region, grid, tp, pp, dp, chunk, cp)
    if key > _MASK64:
        raise ValueError(f"--seed {seed} is too large for {grid.streams} random streams; use a "
                         f"seed below {(_MASK64 + 1) // grid.streams}")
    return _mix64(key)


# ---- the device's default generator ----------------------------------------------------------

# Tensors on the meta device (engine/dryrun) draw no random numbers: their streams are kept as
# CPU generator states, so the same trackers run unchanged.
_HOST = ("cpu", "meta")


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type in _HOST:
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type in _HOST:
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _fresh_state(device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu" if device.type in _HOST else device)
    return gen.manual_seed(seed).get_state()


class RNGTracker:
    """One model chunk's random streams, one generator state per region (see the module doc)."""

    def __init__(self, seeds: dict[str, int], device: torch.device | str = "cpu"):
        missing = {"replicated", "split"} - set(seeds)
        if missing:
            raise ValueError(f"RNGTracker needs seeds for {sorted(missing)}")
        self.device = torch.device(device)
        self.seeds = dict(seeds)
        self.states = {r: _fresh_state(self.device, s) for r, s in seeds.items() if r != "default"}
        self._active: set[str] = set()
        # context-manager factories entered around every recomputation (checkpoint_context): the
        # modes a caller's step runs under, which autograd does not keep for the recomputation
        # (the dry run's host-read mode, engine/dryrun/build.py)
        self.recompute_modes: list = []

    @contextlib.contextmanager
    def fork(self, region: str):
        """Draw from ``region``'s stream inside the block; the default stream is left untouched."""
        if region not in self.states:
            raise ValueError(f"unknown random region {region!r}; use one of {sorted(self.states)}")
        if region in self._active:
            raise RuntimeError(f"RNGTracker.fork({region!r}) inside itself")
        saved = _get_state(self.device)
        _set_state(self.device, self.states[region])
        self._active.add(region)
        try:
            yield
        finally:
            self._active.discard(region)
            self.states[region] = _get_state(self.device)
            _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {r: s.clone() for r, s in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        if set(states) != set(self.states):
            raise ValueError(f"RNGTracker states for {sorted(states)}, expected {sorted(self.states)}")
        self.states = {r: s.clone() for r, s in states.items()}

    def checkpoint_context(self):
        """``context_fn`` for ``torch.utils.checkpoint(use_reentrant=False)``: the recomputation
        starts from the region states the original forward started from, and leaves the streams
        where they were before it (later forwards have moved them on)."""
        start: dict[str, torch.Tensor] = {}

        @contextlib.contextmanager
        def forward():
            start.update(self.get_states())
            yield

        @contextlib.contextmanager
        def recompute():
            now = self.get_states()
            self.set_states(start)
            try:
                with contextlib.ExitStack() as modes:
                    for mode in self.recompute_modes:
                        modes.enter_context(mode())
                    yield
            finally:
                self.set_states(now)

        return forward(), recompute()


class ModelParallelRNG:
    """This rank's trackers, one per model chunk, and the seeding of the default generator."""

    def __init__(self, seed: int, grid: StreamGrid, tp: int = 0, pp: int = 0, dp: int = 0,
                 cp: int = 0, device: torch.device | str = "cpu"):
        self.seed, self.grid, self.device = seed, grid, torch.device(device)
        self.coords = dict(tp=tp, pp=pp, dp=dp, cp=cp)
        replicated = dict(self.coords, tp=0)  # the same stream on every TP rank
        self.default_seed = stream_seed(seed, "default", grid, chunk=0, **replicated)
        self.trackers = [
            RNGTracker({"replicated": stream_seed(seed, "replicated", grid, chunk=c, **replicated),
                        "split": stream_seed(seed, "split", grid, chunk=c, **self.coords)},
                       self.device)
            for c in range(grid.vp)]

    @classmethod
    def for_state(cls, seed: int, ps, vp: int = 1) -> "ModelParallelRNG":
        grid = StreamGrid(tp=ps.tp_size, pp=ps.pp_size, dp=ps.dp_size, vp=vp, cp=ps.cp_size)
        return cls(seed, grid, tp=ps.tp_rank, pp=ps.pp_rank, dp=ps.dp_rank, cp=ps.cp_rank,
                   device=ps.device)

    def seed_default(self) -> None:
        """Seed the process's default generators (CPU, and the device's) with the default stream."""
        torch.manual_seed(self.default_seed)

    def restart_at(self, step: int) -> None:
        """Every stream, and the default generators, from its seed mixed with ``step`` (a resume
        that loads no per-rank state: the masks after step ``step`` do not repeat those of steps
        1, 2, ...); distinct steps, distinct seeds (``_mix64`` is a bijection)."""
        def at(seed: int) -> int:
            return _mix64((seed + step * 0x9E3779B97F4A7C15) & _MASK64)
        for tracker in self.trackers:
            tracker.set_states({r: _fresh_state(self.device, at(s))
                                for r, s in tracker.seeds.items() if r in tracker.states})
        torch.manual_seed(at(self.default_seed))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tracker's states as CPU tensors, ``rng/tracker/<chunk>/<region>`` (checkpoints)."""
        return {f"rng/tracker/{c}/{r}": s.cpu() for c, t in enumerate(self.trackers)
                for r, s in t.get_states().items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for c, tracker in enumerate(self.trackers):
            prefix = f"rng/tracker/{c}/"
            states = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if states:
                tracker.set_states(states)
