"""``--distributed-backend``: auto (the device's backend), or gloo on any device; a backend the
device cannot run is refused before any process group, in one line."""
from __future__ import annotations

import pytest

from engine.base import ConfigError
from engine.config.cli import parse_args
from engine.training.validate import validate_run
from parallel.grid.launch import LaunchEnv

ARGS = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--device", "cpu"]


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_a_backend_of_another_device_is_refused(backend):
    with pytest.raises(ConfigError) as exc:
        validate_run(parse_args(ARGS + ["--distributed-backend", backend]), LaunchEnv())
    assert str(exc.value) == (f"--distributed-backend {backend} does not run on a cpu device (its "
                              f"backend is gloo); use auto, gloo, or the device it needs")


def test_gloo_and_auto_are_accepted_and_unknown_names_refused():
    for backend in ("auto", "gloo"):
        validate_run(parse_args(ARGS + ["--distributed-backend", backend]), LaunchEnv())
    with pytest.raises(ConfigError, match="--distributed-backend"):
        parse_args(ARGS + ["--distributed-backend", "mpi"])
