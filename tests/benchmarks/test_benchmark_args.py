"""Bad arguments to the benchmarks: one line on stderr and exit status 2, before any process is
launched or any collective issued. Every way a benchmark starts work (torchrun jobs, spawned rank
groups, trainers, timed loops) fails the test if it is reached."""
from __future__ import annotations

import importlib

import pytest
import torch.multiprocessing as mp

import benchmarks.common as common

# module -> its attributes that start work (launches, process groups, trainers, timed loops)
LAUNCHES = {
    "benchmarks.peers.compare": ("torchrun", "run_layout"),
    "benchmarks.peers.release": ("export_tree", "job"),
    "benchmarks.peers.overhead": ("engine_side",),
    "benchmarks.communication.tp_overlap": ("torchrun", "timeline", "job"),
    "benchmarks.communication.data_parallel": ("run_distributed",),
    "benchmarks.communication.scaling": ("torchrun", "single_thread_peak_tflops", "run_mode"),
    "benchmarks.communication.call_cost": ("run",),
    "benchmarks.memory.long_context": ("run",),
    "benchmarks.host.checkpoint": ("run_size", "build"),
    "benchmarks.host.kernels": ("_median_ms", "_cases"),
    "benchmarks.host.step_overhead": ("build",),
    "benchmarks.pipeline.bubble": ("run_distributed",),
}

CASES = [
    ("benchmarks.peers.compare", ["--layouts", "1,1,1", "--steps", "2", "--warmup", "2"],
     "--steps 2 must exceed --warmup 2"),
    ("benchmarks.peers.compare", ["--repeats", "0"], "--repeats must be at least 1"),
    ("benchmarks.peers.compare", ["--layouts", "2,1"], "a layout is three integers"),
    ("benchmarks.peers.compare", ["--layouts", "3,1,1"], "do not split over tp=3"),
    ("benchmarks.peers.release", ["--steps", "5", "--warmup", "5"], "--steps 5 must exceed --warmup 5"),
    ("benchmarks.peers.release", ["--repeats", "0"], "--repeats must be at least 1"),
    ("benchmarks.peers.overhead", ["--rounds", "0"], "--rounds must be at least 1"),
    ("benchmarks.communication.tp_overlap", ["--steps", "3", "--warmup", "3"],
     "--steps 3 must exceed --warmup 3"),
    ("benchmarks.communication.data_parallel", ["--steps", "1"], "--steps 1 must exceed"),
    ("benchmarks.communication.data_parallel", ["--dp", "2", "0"], "--dp must be at least 1"),
    ("benchmarks.communication.data_parallel", ["--repeats", "0"], "--repeats must be at least 1"),
    ("benchmarks.communication.scaling", ["--nprocs", "a"], "--nprocs takes comma-separated"),
    ("benchmarks.communication.scaling", ["--layouts", "2,1"], "a layout is three integers"),
    ("benchmarks.communication.scaling", ["--repeats", "0"], "--repeats must be at least 1"),
    ("benchmarks.communication.call_cost", ["--blocks", "0"], "--blocks must be at least 1"),
    ("benchmarks.communication.call_cost", ["--calls", "0"], "--calls must be at least 1"),
    ("benchmarks.communication.call_cost", ["--calls", "x"], "invalid int value: 'x'"),
    ("benchmarks.memory.long_context", ["--seq", "x"], "--seq takes comma-separated integers"),
    ("benchmarks.memory.long_context", ["--cp", "0"], "--cp needs distinct positive integers"),
    ("benchmarks.memory.long_context", ["--seq", "1000", "--cp", "3"],
     "sequence length 1000 does not split"),
    ("benchmarks.host.checkpoint", ["--sizes", "10XB"], "--sizes: a size is a number with KB"),
    ("benchmarks.host.checkpoint", ["--repeats", "0"], "--repeats must be at least 1"),
    ("benchmarks.host.kernels", ["--reps", "0"], "--reps must be at least 1"),
    ("benchmarks.host.step_overhead", ["--steps", "0"], "--steps must be at least 1"),
    ("benchmarks.host.step_overhead", ["--profile-layers", "50,x"], "--profile-layers takes"),
    ("benchmarks.pipeline.bubble", ["--steps", "2", "--warmup", "2"],
     "--steps 2 must exceed --warmup 2"),
]


def _refuse(*args, **kwargs):
    pytest.fail("a bad argument reached a launch")


@pytest.mark.parametrize("module, argv, message", CASES,
                         ids=[f"{m.rsplit('.', 1)[1]} {' '.join(a)}" for m, a, _ in CASES])
def test_bad_argument_is_one_line_and_exit_2_before_any_launch(module, argv, message, monkeypatch,
                                                               capsys):
    mod = importlib.import_module(module)
    for name in LAUNCHES[module]:
        monkeypatch.setattr(mod, name, _refuse)
    monkeypatch.setattr(common, "torchrun", _refuse)
    monkeypatch.setattr(mp, "start_processes", _refuse)
    monkeypatch.setattr(mp, "spawn", _refuse)
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert "error: " in lines[0] and message in lines[0], lines[0]
