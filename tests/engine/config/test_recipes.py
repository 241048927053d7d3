"""The shipped recipes (configs/*.yaml) as their users run them: each passes the trainer's own
checks at the process count its header names, `make train-serial` runs it in one process, and
the recipe of `make train` takes the interleaved schedule from `--vp` alone."""
from __future__ import annotations

import pytest

from engine.config.cli import parse_args
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv


def _validate(argv: list[str], world: int):
    return validate_run(parse_args(argv), LaunchEnv(0, world, 0, world))


@pytest.mark.parametrize("recipe,world", [("configs/train_3d.yaml", 8), ("configs/tiny_serial.yaml", 1),
                                          ("configs/compression_policy.yaml", 2)])
def test_each_recipe_passes_the_trainers_checks(recipe, world):
    grid, _ = _validate(["--config", recipe], world)
    assert grid.world_size == world


def test_the_compression_recipe_takes_every_process_as_a_data_parallel_rank():
    """The policy recipe pins no dp: with 4 processes it runs dp 4, as its header says."""
    grid, _ = _validate(["--config", "configs/compression_policy.yaml"], 4)
    assert grid.dp == 4


def test_make_train_serial_runs_the_recipe_in_one_process():
    """The Makefile's serial run of the 3D recipe passes the trainer's checks in one process; the
    only note is the recipe's sequence parallelism, which needs tp > 1 (no schedule is pinned)."""
    makefile = open("Makefile").read()
    line = next(x for x in makefile.splitlines() if "--config configs/train_3d.yaml --tp 1" in x)
    argv = line.split("-m engine.train ", 1)[1].split()
    grid, notes = _validate(argv, 1)
    assert grid.world_size == 1 and [n.split(" has no effect")[0] for n in notes] == \
        ["--sequence-parallel"], notes


def test_the_3d_recipe_takes_virtual_stages_from_vp_alone():
    """`--vp 2` on the recipe of `make train` selects the interleaved schedule (the recipe pins
    no schedule that would contradict it)."""
    grid, _ = _validate(["--config", "configs/train_3d.yaml", "--vp", "2"], 8)
    cfg = parse_args(["--config", "configs/train_3d.yaml", "--vp", "2"])
    assert grid.pp == 2 and cfg.parallel.chunks_per_rank == 2
