"""Defects planted back into a process, to show that a check finds them (module-level functions:
the fuzzer's pool calls one in each rank it spawns, ``engine.fuzz.pool.Pool(setup=...)``)."""
from __future__ import annotations


def owner_units(roots):
    """The overlapped parameter gather's rule before the fix: each module waits only for the
    parameters it owns directly (a parent reading a child's weight reads it unwaited)."""
    return [(m, list(m.parameters(recurse=False))) for root in roots for m in root.modules()]


def gather_in_owning_modules() -> None:
    import parallel.dp.param_gather as param_gather
    param_gather.gather_units = owner_units


def sum_instead_of_mean() -> None:
    """The DP reduction sums the replicas' gradients instead of averaging them."""
    from parallel.dp.reducer import GradReducer
    start = GradReducer._start

    def _start(self, bucket, group=None):
        bucket.data.mul_(self.dp)  # cancels the division by dp that precedes the reduction
        return start(self, bucket, group)

    GradReducer._start = _start


def validation_from_the_last_rank() -> None:
    """Validation reads its loss from the last pipeline rank, as if every schedule ended there:
    under zb-v's V placement the last virtual stage is on pipeline rank 0, so it reads nothing
    (training's loss, read through the step statistics, is unaffected)."""
    import engine.training.step as step
    read = step.mean_loss_over_grid

    def mean_loss_over_grid(local_sum, ps, device, holds_loss=None, clock=None):
        return read(local_sum, ps, device, holds_loss=None, clock=clock)

    step.mean_loss_over_grid = mean_loss_over_grid
