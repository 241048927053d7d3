import sys, torch
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--precision", "fp32", "--lr", "2e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "constant", "--train-iters", "4", "--timeout-s", "60"]
def run(argv):
    t = Trainer(parse_args(BASE + argv))
    try:
        return [r["loss"] for r in t.train().records], t.memory
    finally:
        t.close()
def layouts(ps, extra):
    return {k: run(v + extra) for k, v in {"z2": ["--dp", "2", "--use-distributed-optimizer", "--zero-stage", "2"],
                                   "z3": ["--dp", "2", "--data-parallel-sharding-strategy", "optim_grads_params"]}.items()}
if __name__ == "__main__":
    extra = sys.argv[1:]
    serial = run(extra)
    res = run_distributed(layouts, grid=RankGrid(dp=2), args=(extra,), timeout_s=60, deadline_s=300)
    print("serial", serial[0])
    for k, v in res[0].items(): print(k, v[0], {kk: vv for kk, vv in v[1].items() if not kk.endswith("dtype")})
