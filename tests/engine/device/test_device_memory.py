"""The free device memory a process may count on (engine/device/runtime.py ``available_memory``):
a device of its own counts whole; only processes that can be on one device together (gloo, one
visible device) divide it. The device and its memory are faked: no accelerator is needed."""
import pytest
import torch

from engine.config.cli import parse_args
from engine.device import runtime
from engine.training import validate
from parallel.grid.launch import LaunchEnv

GIB = 2 ** 30
ARGS = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "2"]


@pytest.fixture
def one_gpu(monkeypatch):
    """A CUDA device of 96 GiB with 80 free; ``visible[0]`` devices seen by this process."""
    visible = [1]
    monkeypatch.setattr(runtime, "device_count", lambda kind: visible[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (80 * GIB, 96 * GIB))
    return visible


def test_one_visible_device_is_divided_only_where_processes_share_it(one_gpu):
    # Slurm --gpus-per-task=1: every task sees its own GPU as device 0; under NCCL (the default
    # backend of a GPU) no two ranks are on one device, so the whole of it is this task's
    assert runtime.available_memory("cuda", 1, 2) == (80 * GIB, "free on cuda:0 (of 96.0 GiB)")
    assert runtime.available_memory("cuda", 7, 8, backend="nccl") == (80 * GIB,
                                                                      "free on cuda:0 (of 96.0 GiB)")
    # --distributed-backend gloo puts the node's processes on the one device together
    assert runtime.available_memory("cuda", 1, 2, backend="gloo") == (
        40 * GIB, "free on cuda:0 (of 96.0 GiB, shared by 2 processes on it)")
    assert runtime.available_memory("cuda", 0, 1, backend="gloo")[0] == 80 * GIB  # alone on it
    one_gpu[0] = 2  # a device each, even under gloo: the whole of its own
    assert runtime.available_memory("cuda", 1, 2, backend="gloo") == (80 * GIB,
                                                                      "free on cuda:1 (of 96.0 GiB)")


def test_the_run_checks_memory_with_the_backend_it_runs(one_gpu, monkeypatch):
    """validate_run hands the resolved backend to the memory figure (and to the estimate)."""
    seen = []
    monkeypatch.setattr(validate, "detect_device_type", lambda requested="auto": "cuda")
    monkeypatch.setattr(validate, "memory_problem",
                        lambda cfg, grid, rank, available, source, backend, *a, **k:
                        seen.append((available, source, backend)))
    launch = LaunchEnv(1, 2, 1, 2)  # two tasks on a node, each seeing one GPU
    validate.validate_run(parse_args(ARGS), launch)
    validate.validate_run(parse_args(ARGS + ["--distributed-backend", "gloo"]), launch)
    assert seen == [(80 * GIB, "free on cuda:0 (of 96.0 GiB)", "nccl"),
                    (40 * GIB, "free on cuda:0 (of 96.0 GiB, shared by 2 processes on it)", "gloo")]
