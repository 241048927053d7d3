"""Which transformer layers each pipeline stage holds.

With ``pp`` ranks and ``vp`` model chunks per rank there are ``pp * vp`` virtual stages. Virtual
stage ``chunk * pp + pp_rank`` holds the ``chunk``-th chunk of rank ``pp_rank`` (Megatron's
interleaving): with pp=2, vp=2 and 8 layers, rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and
6-7, so a micro-batch travels rank 0 -> 1 -> 0 -> 1.

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

    candidates = sorted({n + e for n in range(1, num_layers + 1) for e in set(extra)})
    counts = None
    for bound in candidates:
        if bound + eps < 1 + max(extra):
            continue  # every stage must get at least one layer
        caps = capacity(bound)
        if sum(caps) >= num_layers:
            counts = caps
            break
    assert counts is not None  # bound = num_layers + max(extra) always fits

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
                 first_last_weight: float = 0.0) -> list[range]:
    """The layer ranges of the ``vp`` chunks that pipeline rank ``pp_rank`` holds, chunk order."""
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"stage_layers: pp_rank must be in [0, {pp}), got {pp_rank!r}")
    parts = partition_layers(num_layers, pp, vp, first_last_weight)
    return [parts[chunk * pp + pp_rank] for chunk in range(vp)]


def virtual_stage(pp_rank: int, chunk: int, pp: int) -> int:
    """Index of the virtual stage that chunk ``chunk`` of rank ``pp_rank`` runs."""
    return chunk * pp + pp_rank
