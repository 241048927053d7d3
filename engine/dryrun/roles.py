"""The distinct rank roles of a layout: which ranks hold and send the same, and whom to build.

Pure arithmetic on the rank grid and the layer partition, no torch.distributed. What a rank holds
depends only on its pipeline stage in this engine:

- the stage's chunks (``parallel.pipeline.partition.stage_layers``): their layer counts, and
  whether one of them carries the embedding (virtual stage 0) or the output layer and loss (the
  last virtual stage; with tied embeddings its own copy of the word embedding);
- the micro-batches it keeps in flight, from the schedule (``in_flight_peaks``): 1F1B keeps
  ``pp - stage`` on a stage, so middle stages of one shape differ in activation memory only.

TP and CP positions change no byte count: the vocabulary is padded to a multiple of 128 x tp so
that every TP rank holds V_pad / tp rows (the padding rows sit on the last TP ranks), heads and
key/value groups split evenly, CP ranks hold equal sequence shards. ZeRO pads every gradient
bucket to a multiple of dp x 16 elements, so every shard of the DP x CP group has the same size
(the padding sits in the last ranks' shards), but the fix-ups after the reduction work on a rank's
own shard: the all-reduce over TP of the sequence-parallel norms' gradients
(parallel/grads/main_grad.py) covers the part of those norms that lies in the rank's shard, and none
at all when no norm does. So under ZeRO a stage's role is split by ``shard_signatures`` (computed
from the built reducer's buckets, identical on every rank of the stage) into the shard positions
that sum the same number of elements; large models, whose norms sit in buckets of their own, split
into none. tests/engine/dryrun/test_dryrun.py builds every rank of small layouts and checks that the
ranks of one role record the same bytes.

Mixture-of-experts layers (docs/moe.md): an MoE layer's experts are split over the EP ranks of the
stage (E/ep each, ``parallel/grid/expert_groups.py``), so the ranks of a stage hold different
experts but the same number of them: the expert part is per EP rank and changes no byte count either
(``RoleRecord.holds`` lists which experts each EP rank holds). Which layers are MoE layers
(``--moe-layer-freq``) does: a stage's signature counts its MoE layers per chunk.

A role is the set of stages with the same signature (embedding?, output?, layer count and MoE
layer count per chunk);
its representative is the rank at tp = cp = dp = 0 of the stage with the most micro-batches in
flight, so the role's largest activation memory is the one measured.

Worked example: 16 ranks, tp 2, pp 4, dp 2 (order tp-dp-pp, pipeline stride 4), 8 layers, 1F1B
with 8 micro-batches: stage 0 (first: embedding, layers 0-1, 4 in flight), stages 1 and 2 (middle:
2 layers each, 3 and 2 in flight), stage 3 (last: output layer and loss, 1 in flight). Roles:
first {0, 1, 2, 3} built as rank 0, middle {4..11} built as rank 4 (stage 1), last {12..15}
built as rank 12.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.pipeline.partition import placement_stages, stage_layers
from parallel.pipeline.schedules import build_schedule, in_flight_peaks
from parallel.grid.topology import RankGrid


@dataclass(frozen=True)
class Role:
    name: str                        # "only stage", "first stage", "middle stages", "last stage",
                                     # "first and last stage", "turn stage" (zb-v)
    stages: tuple[int, ...]          # pipeline ranks with this role
    ranks: tuple[int, ...]           # every global rank of those stages, ascending
    representative: int              # the global rank that is built
    chunks: tuple[range, ...]        # the representative's layer ranges, chunk order
    embedding: bool                  # a chunk holds the input embedding (virtual stage 0)
    output: bool                     # a chunk holds the output layer and the loss
    in_flight: dict                  # stage -> most (micro-batch, chunk) activations held at once
    moe_layers: int = 0              # MoE layers among the representative's chunks

    @property
    def stage(self) -> int:
        """The representative's pipeline stage."""
        return max(self.stages, key=lambda s: (self.in_flight[s], -s))


def stage_in_flight(cfg, pp: int, num_micro: int) -> list[int]:
    """Most (micro-batch, chunk) activations each pipeline rank holds at once in the run's schedule
    (1 per micro-batch without a pipeline: one forward and its backward at a time)."""
    if pp == 1:
        return [1]
    lists = build_schedule(cfg.parallel.pipeline_schedule, pp, num_micro,
                           cfg.parallel.virtual_pipeline_size)
    return in_flight_peaks(lists)


def _name(embedding: bool, output: bool, count: int, pp: int, turn: bool = False) -> str:
    if embedding and output:
        return "only stage" if pp == 1 else "first and last stage"  # zb-v's rank 0
    if turn:
        return "turn stage"  # zb-v's last rank: both chunks of the V's bottom
    if embedding:
        return "first stage"
    if output:
        return "last stage"
    return "middle stage" + ("s" if count > 1 else "")


def rank_roles(cfg, grid: RankGrid) -> list[Role]:
    """The layout's roles in pipeline order; ``cfg`` is the run's RunConfig (already validated)."""
    par, pp = cfg.parallel, grid.pp
    vp, placement = (par.chunks_per_rank, par.placement) if pp > 1 else (1, "loop")  # zb-v: 2, "v"
    num_micro = cfg.data.num_microbatches(grid.dp)
    flight = stage_in_flight(cfg, pp, num_micro)
    by_signature: dict[tuple, list[int]] = {}
    layers = {}
    for stage in range(pp):
        chunks = tuple(stage_layers(cfg.model.num_layers, pp, vp, stage, par.stage_end_weight,
                                    placement))
        layers[stage] = chunks
        virtual = placement_stages(pp, vp, stage, placement)  # as the trainer builds them
        turn = any(b - a == 1 for a, b in zip(virtual, virtual[1:]))  # zb-v's last rank: no hop
        moe = tuple(sum(cfg.model.is_moe_layer(i) for i in r) for r in chunks)
        key = (0 in virtual, pp * vp - 1 in virtual, turn, tuple(len(r) for r in chunks), moe)
        by_signature.setdefault(key, []).append(stage)
    roles = []
    for (embedding, output, turn, _, moe), stages in by_signature.items():
        in_flight = {s: flight[s] for s in stages}
        rep_stage = max(stages, key=lambda s: (in_flight[s], -s))
        ranks = tuple(sorted(r for r in range(grid.world_size) if grid.coord(r).pp in stages))
        roles.append(Role(_name(embedding, output, len(stages), pp, turn), tuple(stages), ranks,
                          grid.rank_of(pp=rep_stage), layers[rep_stage], embedding, output,
                          in_flight, sum(moe)))
    return roles


def shard_signatures(buckets, shards: int) -> list[tuple[int, int]]:
    """Per shard index of the DP x CP group: (elements of sequence-parallel parameters, elements of
    tied embedding copies) in that shard, the sizes of the fix-up all-reduces that follow the
    ZeRO reduction. ``buckets``: [(start, end, [(slot start, slot end, sequence_parallel, tied)])]
    in buffer offsets; shard r of a bucket is [start + r n / shards, start + (r + 1) n / shards).

    >>> shard_signatures([(0, 8, [(0, 2, True, False), (2, 8, False, False)])], 2)
    [(2, 0), (0, 0)]
    """
    out = []
    for r in range(shards):
        sp = tied = 0
        for start, end, slots in buckets:
            size = (end - start) // shards
            lo, hi = start + r * size, start + (r + 1) * size
            for s0, s1, is_sp, is_tied in slots:
                n = max(0, min(hi, s1) - max(lo, s0))
                sp += n if is_sp else 0
                tied += n if is_tied else 0
        out.append((sp, tied))
    return out


def split_by_shard(role: Role, grid: RankGrid, signatures: list[tuple[int, int]]) -> list[Role]:
    """``role`` split into the ranks whose ZeRO shard has the same signature; the part holding the
    role's representative comes first, every other part is built at its lowest rank of the
    representative's stage."""
    if len(set(signatures)) == 1:
        return [role]
    index = {r: grid.group_of(r, "dp_cp").index(r) for r in role.ranks}
    mine = signatures[index[role.representative]]
    keys = [mine] + [k for k in dict.fromkeys(signatures) if k != mine]
    parts = []
    for key in keys:
        ranks = tuple(r for r in role.ranks if signatures[index[r]] == key)
        if not ranks:
            continue
        rep = role.representative if key == mine else min(
            r for r in ranks if grid.coord(r).pp == role.stage)
        shards = sorted({index[r] for r in ranks})
        parts.append(Role(f"{role.name} [shards {describe_stages(tuple(shards))}]", role.stages,
                          ranks, rep, role.chunks, role.embedding, role.output, role.in_flight,
                          role.moe_layers))
    return parts


def expert_holdings(cfg, grid: RankGrid, role: Role) -> dict:
    """Which experts the ranks of ``role`` hold in each of its MoE layers (empty without): E/ep per
    EP rank, EP rank i holding experts [i E/ep, (i + 1) E/ep) (``ExpertGrid``), and each rank's EP
    rank (under ETP = tp each TP rank holds its 1/etp slice of those experts), as
    ``{"experts_per_rank", "ep", "edp", "etp", "experts_of_ep_rank": {i: [first, last]},
    "ep_rank_of": {rank: i}}``."""
    from parallel.grid.expert_groups import ExpertGrid
    e = cfg.model.num_experts
    if e is None or not role.moe_layers:
        return {}
    egrid = ExpertGrid(grid, cfg.parallel.expert_model_parallel_size,
                       cfg.parallel.expert_tensor_parallel_size)
    ep = egrid.ep
    per = e // ep
    position = {}
    for group in egrid.groups("ep"):
        for i, r in enumerate(group):
            position[r] = i
    return {"experts_per_rank": per, "ep": ep, "edp": egrid.edp, "etp": egrid.etp,
            "experts_of_ep_rank": {i: [i * per, (i + 1) * per - 1] for i in range(ep)},
            "ep_rank_of": {r: position[r] for r in role.ranks}}


def describe_stages(stages: tuple[int, ...]) -> str:
    """"0", "1-6", "1, 3, 5": the stage list as a short range text."""
    if len(stages) > 2 and list(stages) == list(range(stages[0], stages[-1] + 1)):
        return f"{stages[0]}-{stages[-1]}"
    return ", ".join(str(s) for s in stages)
