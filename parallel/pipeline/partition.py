"""Which transformer layers each pipeline stage holds.

With ``pp`` ranks and ``vp`` model chunks per rank there are ``pp * vp`` virtual stages. Virtual
stage ``chunk * pp + pp_rank`` holds the ``chunk``-th chunk of rank ``pp_rank`` (Megatron's
interleaving): with pp=2, vp=2 and 8 layers, rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and
6-7, so a micro-batch travels rank 0 -> 1 -> 0 -> 1.

Placement: which virtual stage each (rank, chunk) runs. ``"loop"`` is Megatron's interleaving
above (stage ``chunk * pp + rank``); ``"v"`` (ZB-V, Qi et al. 2024, sec. 6) has exactly two chunks
per rank, chunk 0 on stages 0..pp-1 and chunk 1 on stages 2pp-1..pp, so a micro-batch travels
down the ranks and back up: rank 0 holds both the first and the last virtual stage (the embedding
and the output layer), and the middle boundary (stage pp-1 to pp) stays on rank pp-1.

Layers are split by count. The first virtual stage also runs the embedding and the last one the
output layer and loss; ``first_last_weight`` counts each of those as that many layers, so that the
end stages get fewer transformer blocks when the embedding/head is expensive (large vocabularies).
"""
from __future__ import annotations

import math


def _check_sizes(num_layers: int, pp: int, vp: int) -> None:
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vp", vp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"partition_layers: {name} must be a positive integer, got {value!r}")
    stages = pp * vp
    if num_layers < stages:
        raise ValueError(
            f"cannot split {num_layers} layers into pp*vp = {pp}*{vp} = {stages} pipeline stages "
            f"(each needs at least one layer); use --num-layers >= {stages} or reduce "
            f"--pp / --virtual-pipeline-size")


def _layer_counts(num_layers: int, stages: int, extra: list[float]) -> list[int]:
    """Counts n_i >= 1 summing to num_layers that minimise max_i(n_i + extra_i).

    The smallest feasible bound T is found among the values n + extra_i; every stage is then filled
    up to floor(T - extra_i) layers and the surplus is taken back one layer at a time from the most
    loaded stage, preferring the ends of the pipeline (stage 0, the last, stage 1, ...), which in
    practice carry the embedding, the head and the longest warm-up stash.
    """
    eps = 1e-9

    def capacity(bound: float) -> list[int]:
        return [max(1, math.floor(bound - e + eps)) for e in extra]

    def fits(bound: float) -> bool:  # every stage at least one layer, all layers placed
        return bound + eps >= 1 + max(extra) and sum(capacity(bound)) >= num_layers

    # the least candidate n + e (n in 1..num_layers) that fits: both conditions only get easier
    # as the bound grows, so a bisection over n for each distinct e (a billion layers take
    # microseconds, where a scan of every candidate took minutes)
    bounds = []
    for e in set(extra):
        lo, hi = 1, num_layers
        if not fits(hi + e):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid + e) else (mid + 1, hi)
        bounds.append(lo + e)
    assert bounds  # bound = num_layers + max(extra) always fits
    counts = capacity(min(bounds))

    ends_first = []
    lo, hi = 0, stages - 1
    while lo <= hi:
        ends_first.append(lo)
        if hi != lo:
            ends_first.append(hi)
        lo, hi = lo + 1, hi - 1
    rank_of = {stage: i for i, stage in enumerate(ends_first)}
    surplus = sum(counts) - num_layers
    while surplus > 0:
        movable = [s for s in range(stages) if counts[s] > 1]
        stage = max(movable, key=lambda s: (counts[s] + extra[s], -rank_of[s]))
        counts[stage] -= 1
        surplus -= 1
    return counts


def partition_layers(num_layers: int, pp: int, vp: int = 1,
                     first_last_weight: float = 0.0) -> list[range]:
    """One ``range`` of global layer indices per virtual stage, indexed ``chunk * pp + pp_rank``.

    >>> partition_layers(8, pp=2, vp=2)
    [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    >>> partition_layers(10, pp=4, first_last_weight=1.0)
    [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    """
    _check_sizes(num_layers, pp, vp)
    if not isinstance(first_last_weight, (int, float)) or first_last_weight < 0:
        raise ValueError(f"partition_layers: first_last_weight must be a number >= 0, "
                         f"got {first_last_weight!r}")
    stages = pp * vp
    extra = [0.0] * stages
    extra[0] += float(first_last_weight)
    extra[-1] += float(first_last_weight)
    counts = _layer_counts(num_layers, stages, extra)
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def stage_layers(num_layers: int, pp: int, vp: int, pp_rank: int,
                 first_last_weight: float = 0.0, placement: str = "loop") -> list[range]:
    """The layer ranges of the ``vp`` chunks that pipeline rank ``pp_rank`` holds, chunk order.

    >>> stage_layers(8, pp=2, vp=2, pp_rank=0, placement="v")
    [range(0, 2), range(6, 8)]
    """
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"stage_layers: pp_rank must be in [0, {pp}), got {pp_rank!r}")
    parts = partition_layers(num_layers, pp, vp, first_last_weight)
    return [parts[s] for s in placement_stages(pp, vp, pp_rank, placement)]


PLACEMENTS = ("loop", "v")


def _check_placement(placement: str, vp: int | None = None) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown chunk placement {placement!r}; use one of {', '.join(PLACEMENTS)}")
    if placement == "v" and vp is not None and vp != 2:
        raise ValueError(f"the V placement holds exactly 2 chunks per rank, got vp={vp}")


def virtual_stage(pp_rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """Index of the virtual stage that chunk ``chunk`` of rank ``pp_rank`` runs.

    >>> [virtual_stage(r, c, 4) for c in (0, 1) for r in range(4)]
    [0, 1, 2, 3, 4, 5, 6, 7]
    >>> [virtual_stage(r, c, 4, "v") for c in (0, 1) for r in range(4)]
    [0, 1, 2, 3, 7, 6, 5, 4]
    """
    _check_placement(placement)
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"the V placement has chunks 0 and 1, got chunk {chunk}")
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_owner(stage: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(pp rank, chunk) that runs virtual stage ``stage``: the inverse of ``virtual_stage``.

    >>> stage_owner(5, 4), stage_owner(5, 4, "v")
    ((1, 1), (2, 1))
    """
    _check_placement(placement)
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def placement_stages(pp: int, vp: int, pp_rank: int, placement: str = "loop") -> list[int]:
    """The virtual stages of rank ``pp_rank``'s chunks, in chunk order.

    >>> placement_stages(4, 2, 0), placement_stages(4, 2, 0, "v")
    ([0, 4], [0, 7])
    """
    _check_placement(placement, vp)
    return [virtual_stage(pp_rank, chunk, pp, placement) for chunk in range(vp)]
