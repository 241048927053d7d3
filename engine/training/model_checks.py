"""Checks of the built model, agreed on every rank: what the block builds, and replica agreement.

Every copy of a parameter must hold the same values. A parameter is replicated over the
data-parallel ranks (DP x CP; an expert's over its expert-data-parallel group) and, unless it is a
tensor-parallel shard (marked ``tp_sharded``), over the TP ranks. The engine's layers keep it so:
the initializer draws every parameter from its logical name (the same values on every rank of any
layout), and gradients are summed wherever each replica sees part of the data (DP, and over TP the
parameters marked ``sequence_parallel``). A block of a user's that draws a parameter with torch's
own init (different on every data-parallel rank: the default generator is seeded per pipeline,
data and context rank), slices a TP shard by hand without the mark, or applies a replicated
parameter to a sequence shard without the ``sequence_parallel`` mark would train replicas that
drift apart, silently. ``replica_problems`` compares fingerprints of every parameter (its sum and
squared norm, in fp32) over those groups, in one max all-reduce per group, and names the first
that differs and what to do (docs/blocks.md).

The trainer runs it twice: at build, before ZeRO shards the parameters (a different start), and
after the process's second step (its only one in a one-step run): a gradient not summed where it
should be makes the first update differ already. The second, not the first, so that the second
step's forward overlaps the first's parameter gathers as every later step's does; with ZeRO-1/2's
overlapped gather (which this check would wait for, taking the wait from the next forward) after
the run's last step instead, where the gathers are waited for anyway (``replica_check_step``);
ZeRO-3 compares each rank's shard pieces over TP, where the layout is the same. Two
replicas of equal values give equal fingerprints bit for bit; the tolerance (``TOLERANCE`` of the
sum's scale, sqrt(numel) x norm, and of the squared norm) leaves room for a device's
non-deterministic reductions and none for a different draw or a first update on part of the data.

``agreed_problem`` makes a verdict the same on every rank: a problem found on some ranks stops all
of them with the same line before any later collective (a rank that went on would wait forever).
In the normal case it costs one all-reduce of one number and one read on the host.

Worked example: dp=2 with a block holding ``nn.Linear(h, h)``: rank 0 draws weight W0, rank 1 W1;
their squared norms differ by about sqrt(2 / h^2) relative (1e-2 at h = 128), far above 1e-5,
so both ranks stop with "layers.0.gate.weight: its copies on the data-parallel ranks differ at
start-up; draw it through the initializer ...".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.base import ConfigError

TOLERANCE = 1e-5
_DRAW = ("draw it through the initializer (ctx.init.full / ctx.init.param, named from the global "
         "layer index; docs/blocks.md), not torch's own init")
_MARK_SP = ("its gradient comes from part of the data on each TP rank (a sequence shard under "
            "--sequence-parallel, or its rank's heads): mark it `sequence_parallel = True` so its "
            "gradients are summed over the TP ranks (docs/blocks.md)")
_MARK_TP = ("a tensor-parallel shard is marked tp_sharded (ctx.init.param(..., shard_dim=...) "
            "marks it; docs/blocks.md), a replicated parameter is drawn whole")


def fingerprints(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """(n, 2) fp32: each tensor's sum and squared L2 norm, on ``device``."""
    rows = [torch.stack([t.detach().sum(dtype=torch.float32),
                         torch.linalg.vector_norm(t.detach(), dtype=torch.float32).square()])
            for t in tensors]
    if not rows:
        return torch.zeros((0, 2), dtype=torch.float32, device=device)
    return torch.stack(rows).to(device)


def spread_mask(fp: torch.Tensor, numels: torch.Tensor, group) -> torch.Tensor:
    """(n,) bool on fp's device: rows whose fingerprints differ over ``group`` beyond round-off
    (no host read)."""
    n = fp.shape[0]
    if group.size == 1 or n == 0:
        return torch.zeros(n, dtype=torch.bool, device=fp.device)
    both = torch.cat([fp, -fp])  # (2n, 2): the max of each, and minus the min
    group.all_reduce(both, op=dist.ReduceOp.MAX)
    hi, lo = both[:n], -both[n:]
    spread = hi - lo  # (n, 2)
    squares = torch.maximum(hi[:, 1].abs(), lo[:, 1].abs())
    scale = torch.stack([(numels * squares).sqrt(), squares], dim=1)  # (n, 2)
    return (spread > TOLERANCE * scale).any(dim=1)


def _groups(named: list[tuple[str, torch.Tensor, object]], ps, over_dp: bool):
    """(what, group, items) per replication group, in the same order on every rank; the DP groups
    only with ``over_dp``."""
    dense = [x for x in named if not getattr(x[2], "expert_parallel", False)]
    experts = [x for x in named if getattr(x[2], "expert_parallel", False)]
    replicated = [x for x in named if not getattr(x[2], "tp_sharded", False)
                  and not getattr(x[2], "shared_embedding", False)]
    out = []
    if over_dp:
        out += [("data-parallel", ps.dp_cp_group, dense), ("expert-data-parallel", ps.edp_group,
                                                            experts)]
    return out + [("tensor-parallel", ps.tp_group, replicated)]


def replica_problems(named, ps, device, when: str,
                     over_dp: bool = True) -> tuple[torch.Tensor, callable]:
    """Compare ``named`` ((logical name, values, parameter) triples of this rank) over their
    replication groups (``when``: "at start-up" or "after step N"; ``over_dp`` False: TP only, for
    ZeRO-3's shard pieces, see the module doc). Returns the number of differing tensors (a 0-d
    device tensor: no host read) and a function giving the first problem's line."""
    checks = []
    count = torch.zeros((), dtype=torch.int64, device=device)
    for what, group, items in _groups(named, ps, over_dp):
        fp = fingerprints([t for _, t, _ in items], device)
        numels = torch.tensor([float(t.numel()) for _, t, _ in items], device=device)
        bad = spread_mask(fp, numels, group)
        checks.append((what, items, bad))
        count = count + bad.sum()

    def first() -> str | None:
        for what, items, bad in checks:
            for (name, _, _), differs in zip(items, bad.tolist()):
                if differs:
                    hint = (_DRAW if what != "tensor-parallel" else
                            _MARK_TP if when == "at start-up" else _MARK_SP)
                    return f"{name}: its copies on the {what} ranks differ {when}; {hint}"
        return None
    return count, first


def agreed_problem(ps, count: torch.Tensor, line) -> None:
    """Stop every rank with the same line when any rank found a problem: ``count`` (0-d device
    tensor) is this rank's number of problems, ``line()`` its first. One all-reduce and one read
    on the host when none is found; the lines are gathered only when some rank has one."""
    total = count.reshape(1).to(torch.float32).clone()
    ps.world_group.all_reduce(total, op=dist.ReduceOp.MAX)
    if int(total.item()) == 0:
        return
    failed = ps.world_group.failures(line() if int(count) else None)
    rank, why = failed[0]
    more = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise ConfigError(f"rank {rank}: {why}{more}")


def block_problems(cfg, ps, chunks) -> list[str]:
    """What a rank's built layers lack for the run's flags: context parallelism needs
    ``ParallelAttention`` (the attention that sees the whole sequence), ``--num-experts`` an MoE
    layer wherever ``--moe-layer-freq`` puts one."""
    from models.layers import ParallelAttention
    from models.moe.layer import MoELayer
    m, out = cfg.model, []
    if ps.cp_size > 1 and any(len(c.layers) for c in chunks) and not any(
            isinstance(x, ParallelAttention) for c in chunks for x in c.modules()):
        out.append(f"--cp {ps.cp_size}: --block {m.block} has no models.layers.ParallelAttention, "
                   f"the attention that sees the whole sequence under context parallelism; build "
                   f"the block's attention from it or use --cp 1")
    for chunk in chunks:
        for index, layer in zip(chunk.layer_range, chunk.layers):
            if m.is_moe_layer(index) and not any(isinstance(x, MoELayer) for x in layer.modules()):
                out.append(f"--num-experts {m.num_experts}: layer {index} of --block {m.block} "
                           f"builds no mixture of experts (models.moe.MoELayer); build its MLP "
                           f"with models.moe.layer.build_mlp (a TransformerBlock subclass does) or "
                           f"drop --num-experts")
                return out
    return out


def check_built_model(trainer) -> None:
    """At build, before the optimizer shards anything: the block's structure and the replicas'
    start, one verdict on every rank."""
    chunks = trainer.chunks
    problems = block_problems(trainer.cfg, trainer.ps, chunks)
    if torch.device(trainer.dev.device).type == "meta":  # the dry run: one rank, no values
        if problems:
            raise ConfigError(problems[0])
        return
    named = [(n, p, p) for c in chunks for n, p in c.logical_named_parameters()]
    count, first = replica_problems(named, trainer.ps, trainer.dev.device, "at start-up")
    if problems:
        count = count + len(problems)
    agreed_problem(trainer.ps, count, lambda: problems[0] if problems else first())


def replica_check_step(trainer, start: int) -> int:
    """The 0-based step after which ``check_after_first_steps`` runs: the process's second (its
    only one in a one-step run); with ZeRO-1/2's overlapped parameter gather, whose wait the check
    would take from the next forward, the run's last, where the gathers are waited for anyway."""
    last = trainer.cfg.optim.train_iters - 1
    gather = getattr(trainer.optimizer, "param_gather", None)
    overlapped = trainer.reducer.zero_stage < 3 and bool(getattr(gather, "overlap", False))
    return last if overlapped else min(start + 1, last)


def check_after_first_steps(trainer, step: int) -> None:
    """After the process's step ``step`` (0-based: its second, or its only one), once ZeRO's
    gathers are in: the first updates kept every replica equal (ZeRO-3: each rank's shard pieces,
    over TP)."""
    trainer.params_ready()
    shards = trainer.reducer.zero_stage == 3   # each rank's pieces: no DP replicas to compare
    if shards:
        named = [(piece.name, values, piece.param)
                 for piece, values in trainer.optimizer.param_pieces()]
    else:
        named = [(n, p, p) for c in trainer.chunks for n, p in c.logical_named_parameters()]
    count, first = replica_problems(named, trainer.ps, trainer.dev.device, f"after step {step + 1}",
                                    over_dp=not shards)
    agreed_problem(trainer.ps, count, first)
