import sys, torch
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.stream_check import StreamChecker
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
BASE = ["--mock-data", "--vocab-size", "64", "--no-progress", "--device", "cpu", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--precision", "fp32",
        "--train-iters", "2", "--timeout-s", "60", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--overlap-param-gather", "--bucket-size-mb", "0.001"]
MOE = ["--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
BLOCKS = {"gpt2": ["--block", "gpt2"], "llama": ["--block", "llama"],
          "moe": ["--block", "gpt2", *MOE], "moe-llama": ["--block", "llama", *MOE],
          "user": ["--block", "tests.helpers.blocks:DirectNormBlock"]}
def _checked(argv):
    checker = StreamChecker()
    with checker.installed():
        trainer = Trainer(parse_args(BASE + argv))
        try:
            losses = [r["loss"] for r in trainer.train().records]
        finally:
            trainer.close()
    return losses, list(checker.violations)
def runs(ps, names):
    return {n: _checked(BLOCKS[n]) for n in names}
if __name__ == "__main__":
    res = run_distributed(runs, grid=RankGrid(dp=4), args=(sys.argv[1:],), timeout_s=60, deadline_s=600)
    for r in range(4):
        for k, v in res[r].items(): print(r, k, v[0], v[1][:3])
