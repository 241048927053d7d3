"""ZeRO's overlapped parameter gather waits for every parameter before its first read, whatever
reads it: the trainer under the stream-order checker on 4 gloo ranks (dp 4, ZeRO-1 and ZeRO-2,
--overlap-param-gather, buckets of ~1 KB so that parameters of one block sit in different buckets;
2 steps: the second forward reads what the first update gathers).

- gpt2, llama (SwiGLU's gate and up are read by the parent MLP through ``_linear``), MoE layers
  with ep 2, so EDP = 2 on a communicator of its own (expert weights in ``ParameterDict``s
  without a forward; at ep 1 the EDP group is the DP group, whose later gathers order the
  earlier ones on the same stream), and a user block
  that reads its norms' parameters itself: no violation, with the waits at block boundaries
  (parallel/dp/param_gather.py ``gather_units``).
- The same runs with the waits planted back in each parameter's owning module (the rule before
  the fix): the checker reports the unordered reads where they are issued (tensor_parallel/layers.py,
  the user block), and none for gpt2 and the MoE blocks, whose modules read only their own
  parameters (the experts' stacked weights belong to the module that runs them).
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import parallel.dp.param_gather as param_gather
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.runtime.stream_check import StreamChecker
from parallel.grid.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
from tests.helpers.planted import owner_units

BASE = ["--mock-data", "--vocab-size", "64", "--no-progress", "--device", "cpu", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--precision", "fp32",
        "--train-iters", "2", "--timeout-s", "60", "--use-distributed-optimizer",
        "--overlap-param-gather", "--bucket-size-mb", "0.001"]
MOE = ["--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
BLOCKS = {"gpt2": ["--block", "gpt2"], "llama": ["--block", "llama"],
          "moe": ["--block", "gpt2", *MOE], "moe-llama": ["--block", "llama", *MOE],
          "user": ["--block", "tests.helpers.blocks:DirectNormBlock"]}


def _checked(argv: list[str]) -> tuple[list[float], list[str]]:
    checker = StreamChecker()
    with checker.installed():
        trainer = Trainer(parse_args(BASE + argv))
        try:
            losses = [r["loss"] for r in trainer.train().records]
        finally:
            trainer.close()
    return losses, list(checker.violations)


def runs(ps) -> dict:
    out = {}
    for name, block in BLOCKS.items():
        for stage in ("1", "2"):
            out[name, stage] = _checked(block + ["--zero-stage", stage])
    with mock.patch.object(param_gather, "gather_units", owner_units):
        for name, block in BLOCKS.items():
            out[name, "planted"] = _checked(block + ["--zero-stage", "1"])
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(runs, grid=RankGrid(dp=4), timeout_s=60, deadline_s=600)


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("stage", ["1", "2"])
def test_no_read_before_its_gather(results, block, stage):
    for rank in range(4):
        losses, violations = results[rank][block, stage]
        assert violations == [], violations
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("block, where", [("llama", "parallel/tensor_parallel/layers.py"),
                                          ("user", "tests/helpers/blocks.py")])
def test_waits_in_owning_modules_are_caught(results, block, where):
    for rank in range(4):
        _, violations = results[rank][block, "planted"]
        assert violations, f"{block}: the planted defect went unseen"
        assert all("all_gather on dp" in v or "all_gather on edp" in v for v in violations), violations
        assert any(where in v for v in violations), violations


@pytest.mark.parametrize("block", ["gpt2", "moe", "moe-llama"])
def test_owning_modules_suffice_for_gpt2_and_moe(results, block):
    """gpt2's modules read only their own parameters, and so do the MoE layers' experts (one
    stacked parameter per projection, read by the module that holds it): the old rule was right
    there, so the planted runs above fail for the reason named, not for any use of the old rule."""
    for rank in range(4):
        assert results[rank][block, "planted"][1] == []
