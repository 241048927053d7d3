"""One training step of one built rank, recorded: collectives, memory, activations, communicators.

``record_role`` builds the role's representative rank (build.py) and runs ``Stepper.run`` on meta
micro-batches of the run's shape: the forward and backward of every micro-batch through the
pipeline schedule (``parallel.pipeline.executor``, the same transfers in the same order), the DP
reduction, the sequence-parallel and tied-embedding all-reduces, the statistics all-reduce and the
optimizer step with ZeRO's parameter all-gather. What it records:

- every ``CommEvent`` the rank's ``ps.comm`` observers see (op, group kind, dtype, payload bytes,
  and for a receive the bytes it landed, ``received_bytes``; ``counted`` is False for the few that ``ps.comm.uncounted()`` keeps out of the step's traffic,
  the pipeline bubble's two instants), and the step's per-kind counters, from which
  ``engine.training.step_record.comm_metrics`` gives the metrics' ``*_comm_bytes`` keys;
- ``memory_bytes(reducer, optimizer)``: ``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes``
  by dtype, computed from the constructed objects exactly as the run's metrics are;
- activations: every tensor autograd saves for backward (``saved_tensors_hooks``), counted once per
  storage and never for parameters, live from its forward until its backward frees it; the peak
  over the step is ``activation_bytes``. It runs in the schedule's own order, so it is the peak
  of the micro-batches in flight; per micro-batch it is that over ``in_flight``. Other stages of
  the role hold ``per micro-batch x their in-flight count`` (roles.py). Not included: gradients
  and recomputed tensors while a backward runs (transient), the received gradient buffers, the
  allocator's cache;
- communicators: the process groups of more than one rank this rank belongs to, and its pipeline
  peers, which HCCL and NCCL give buffers of their own (engine/plan/memory.py, comm_buffer_bytes);
- under ZeRO-3, ``gathered_bytes``: the most bytes of whole (gathered) buckets alive at once over
  the step (parallel/dp/zero3.py ``gathered_bytes`` after every gather), the units in flight and
  the kept ones: a transient beside the persistent shards in ``param_bytes``.
"""
from __future__ import annotations

import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.data.packing import MicroBatch
from engine.dryrun.build import META, HostReads, build_rank, fake_rank
from engine.dryrun.roles import Role, expert_holdings
from engine.training.lr_schedule import learning_rate
from engine.training.step_record import comm_metrics
from parallel.runtime.comm_monitor import GROUP_KINDS
from parallel.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F
from parallel.grid.launch import LaunchEnv
from parallel.tensor_parallel import padded_vocab_size

MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself (data_ptr is 0 on the meta device)


class _Held:
    """What autograd keeps for one saved tensor; releases its storage's count when dropped."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """``saved_tensors_hooks`` that count the live bytes of saved tensors, one count per storage,
    parameters (and views of them) left out; ``peak`` is the most live at once."""

    def __init__(self, params):
        self.skip = {_storage(p) for p in params}
        self.refs: dict[int, list] = {}      # storage -> [saved tensors alive, its bytes]
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        key = _storage(t)
        if key in self.skip:
            return t
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [0, t.untyped_storage().nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


@dataclass
class RoleRecord:
    role: Role
    rank: int                       # the rank that was built (the role's representative)
    stage: int                      # its pipeline stage
    memory: dict                    # memory_bytes(): the three keys and their *_by_dtype
    activation_bytes: int           # peak saved activations of the representative's step
    activation_per_stage: dict      # stage -> bytes (per micro-batch x the stage's in-flight)
    collectives: list[dict]         # {"op", "group", "dtype", "bytes", "counted"} in issue order
    comm: dict                      # per group kind: calls, payload_bytes, wire_bytes (counted)
    metrics: dict                   # comm_metrics() keys and the memory keys, as a run reports them
    communicators: int              # process groups of more than one rank that issued collectives
    p2p_peers: int                  # pipeline neighbours it exchanges with
    holds: dict = field(default_factory=dict)
    seconds: float = 0.0
    events: list = field(default_factory=list, repr=False)  # the step's CommEvents (ranks too)
    tensor_devices: frozenset = frozenset()  # of parameters, gradient buffers, optimizer state
    shard_buckets: list | None = None  # ZeRO: roles.shard_signatures' input; None without ZeRO
    gathered_bytes: int = 0         # ZeRO-3: peak bytes of gathered buckets (module docstring)

    @property
    def in_flight(self) -> int:
        return self.role.in_flight[self.stage]


def meta_batches(cfg, ps, num_micro: int) -> list[MicroBatch]:
    """The rank's micro-batches as meta tensors of the run's shape: (b, s) tokens and labels,
    (b, s/cp) under context parallelism; a loss mask with --eod-mask-loss. Packed-document
    metadata is not built: attention runs plain causal (the same collectives and buffers)."""
    b, s = cfg.data.micro_batch_size, cfg.model.seq_length // ps.cp_size

    def one():
        tokens = torch.empty((b, s), dtype=torch.long, device=META)
        labels = torch.empty((b, s), dtype=torch.long, device=META)
        if not cfg.data.eod_mask_loss:
            return MicroBatch(tokens, labels)
        return MicroBatch(tokens, labels, loss_mask=torch.empty((b, s), device=META), loss_tokens=1)
    return [one() for _ in range(num_micro)]


def _communicators(events, reducer=None) -> int:
    """Process groups that issued a collective (setup or step; point-to-point transfers aside):
    HCCL and NCCL create a group's communicator, and its buffers, on its first collective. The
    exchange worker's DP group has the DP group's kind and ranks (its lane tells them apart); with
    a compressing ``reducer`` it counts even when the recorded step is a warm-up step, since the
    first compressed step creates it."""
    groups = {(e.group, e.ranks, e.lane) for e in events if e.op not in ("send", "recv")}
    if reducer is not None and reducer.compressed:  # DP x CP's, and EDP's for expert buckets
        for g in {b.exchange_group for b in reducer.buckets if b.compressor is not None}:
            groups.add((g.kind, g.ranks, g.lane))
    return len(groups)


def _p2p_peers(ps, actions) -> int:
    """Pipeline neighbours this rank's schedule sends to or receives from."""
    if ps.pp_size == 1 or not actions:
        return 0
    prev, nxt = ps.stage_rank((ps.pp_rank - 1) % ps.pp_size), ps.stage_rank((ps.pp_rank + 1) % ps.pp_size)
    peers = set()
    for a in actions:
        if a.kind in (RECV_F, SEND_B):
            peers.add(prev)
        elif a.kind in (SEND_F, RECV_B):
            peers.add(nxt)
    return len(peers)


def _holds(cfg, trainer) -> dict:
    """What the role's ranks hold that differs between positions without changing bytes."""
    ps, out = trainer.ps, {}
    v = cfg.model.vocab_size
    if any(c.pre_process or c.post_process for c in trainer.chunks):
        padded = padded_vocab_size(v, ps.tp_size)
        per = padded // ps.tp_size
        out["vocab_rows_per_tp_rank"] = per
        out["vocab_padding_rows"] = padded - v
        out["vocab_padding_on_tp_ranks"] = [r for r in range(ps.tp_size) if (r + 1) * per > v]
    if trainer.stepper.shared:
        out["tied_embedding_copy"] = True
    if getattr(trainer.optimizer, "sharded", False):
        pad = sum(b.numel - sum(s.numel for s in b.slots) for b in trainer.reducer.buckets)
        out["zero_padding_elements"] = pad
        # the ranks (of each bucket's own group: DP x CP, or EDP for expert buckets) whose shard
        # ends in padding
        out["zero_padding_on_dp_ranks"] = sorted({
            r for b in trainer.reducer.buckets for r in range(b.shard_world)
            if b.numel - sum(s.numel for s in b.slots) > 0
            and b.shard_range(r, b.shard_world)[1] > b.slots[-1].end})
    out["parameters"] = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    # MoE layers: the experts this rank built (global indices per layer; the layer's ``experts``
    # module, models/moe/experts.py LocalExperts, keeps them as ``local``)
    held = {getattr(m, "layer_idx", None): list(m.experts.local) for c in trainer.chunks
            for m in c.modules() if hasattr(getattr(m, "experts", None), "local")}
    if held:
        out["experts_held"] = held
        out["expert_parameters"] = sum(p.numel() for c in trainer.chunks for p in c.parameters()
                                       if getattr(p, "expert_parallel", False))
    return out


def _shard_buckets(trainer) -> list | None:
    """The reducer's buckets with the parameters whose reduced shard is all-reduced again (the
    sequence-parallel norms over TP, the tied embedding copies over the embedding group)."""
    if not getattr(trainer.optimizer, "sharded", False):
        return None
    ps, shared = trainer.ps, {id(p) for p in trainer.stepper.shared}
    sp = ps.tp_size > 1
    return [(b.start, b.end, [(s.start, s.end, sp and getattr(s.param, "sequence_parallel", False),
                               id(s.param) in shared) for s in b.slots])
            for b in trainer.reducer.buckets]


def _devices(trainer) -> frozenset:
    tensors = [p for c in trainer.chunks for p in c.parameters()]
    tensors += [buf.data for buf in trainer.reducer.buffers if buf.data is not None]
    tensors += [b.shard for b in trainer.reducer.buckets if b.shard is not None]
    opt = trainer.optimizer
    tensors += [opt.master] if getattr(opt, "sharded", False) else list(opt.masters)
    return frozenset(t.device.type for t in tensors)


class GatheredPeak:
    """The most bytes ZeRO-3's store (parallel/dp/zero3.py ``ShardedParams``) holds gathered at
    once, read after each of its gathers; nothing without ZeRO-3."""

    def __init__(self, optimizer):
        self.peak = 0
        store = getattr(optimizer, "param_gather", None)
        if store is None or not hasattr(store, "gathered_bytes"):
            return
        gather = store.gather

        def counted(indices) -> None:
            gather(indices)
            self.peak = max(self.peak, store.gathered_bytes())
        store.gather = counted   # this rank's store only, for the recorded step


def record_role(cfg, grid, role: Role, rules: str | None, devices_per_node: int,
                registry=None, rank: int | None = None) -> RoleRecord:
    """Build ``role``'s representative (or ``rank``, another rank of the role) under the fake
    process group and record one step."""
    start = time.perf_counter()
    rank = role.representative if rank is None else rank
    launch = LaunchEnv(rank, grid.world_size, rank % devices_per_node,
                       min(devices_per_node, grid.world_size))
    with fake_rank(rank, grid.world_size):
        setup, events = [], []
        trainer = build_rank(cfg, grid, launch, rules, registry, setup.append)
        ps = trainer.ps
        try:
            ps.comm.observers.remove(setup.append)
            observe = lambda e: events.append((e, ps.comm.counting))  # noqa: E731
            saved = SavedActivations([p for c in trainer.chunks for p in c.parameters()])
            batches = meta_batches(cfg, ps, trainer.num_micro)
            gathered = GatheredPeak(trainer.optimizer)
            ps.comm.observers.append(observe)
            try:
                for tracker in trainer.rng.trackers:  # full recomputation reads as the step does
                    tracker.recompute_modes.append(HostReads)
                with HostReads(), saved.hooks():
                    out = trainer.stepper.run(batches, learning_rate(0, cfg.optim), step=1)
            finally:
                ps.comm.observers.remove(observe)
            # "bytes": the payload handed over (0 for a recv, whose traffic its sender counts);
            # a recv also says what it landed
            collectives = [{"op": e.op, "group": e.group, "dtype": e.dtype, "bytes": e.payload_bytes,
                            "counted": counted,
                            **({"received_bytes": e.received_bytes} if e.op == "recv" else {})}
                           for e, counted in events]
            comm = {k: out.comm[k] for k in GROUP_KINDS}
            flight = role.in_flight[ps.pp_rank]
            per_micro = saved.peak / flight
            record = RoleRecord(
                role, rank, ps.pp_rank, dict(trainer.memory), saved.peak,
                {s: round(per_micro * role.in_flight[s]) for s in role.stages}, collectives, comm,
                {**comm_metrics(out.comm), **{k: trainer.memory[k] for k in MEMORY_KEYS}},
                _communicators(setup + [e for e, _ in events], trainer.reducer),
                _p2p_peers(ps, trainer.stepper.actions),
                {**_holds(cfg, trainer), **({"moe": moe} if (moe := expert_holdings(cfg, grid, role)) else {})},
                events=[e for e, _ in events], tensor_devices=_devices(trainer),
                shard_buckets=_shard_buckets(trainer), gathered_bytes=gathered.peak)
        finally:
            trainer.reducer.remove_hooks()
    record.seconds = time.perf_counter() - start
    return record


def bytes_by_kind(records: list[RoleRecord]) -> dict[str, int]:
    """Payload bytes per step per group kind, summed over every rank of the job (each role's
    representative's counters times its ranks)."""
    total = Counter()
    for r in records:
        for kind, c in r.comm.items():
            total[kind] += c["payload_bytes"] * len(r.role.ranks)
    return dict(total)
