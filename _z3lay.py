import sys, torch
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.state import LaunchEnv
from parallel.topology import RankGrid
from tests.helpers.dist_utils import run_distributed
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu", "--num-layers", "4",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--precision", "fp32", "--lr", "2e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "constant", "--train-iters", "3", "--timeout-s", "60"]
Z3 = ["--data-parallel-sharding-strategy", "optim_grads_params", "--bucket-size-mb", "0.002"]
LAY = {
 "zbv": ["--pp", "2", "--dp", "2", "--pipeline-schedule", "zb-v", *Z3],
 "int": ["--pp", "2", "--dp", "2", "--pipeline-schedule", "interleaved", "--virtual-pipeline-size", "2", "--recompute", "full", *Z3],
 "1f1b": ["--pp", "2", "--dp", "2", *Z3],
 "cp": ["--cp", "2", "--dp", "2", "--num-query-groups", "2", *Z3],
 "tpsp": ["--tp", "2", "--dp", "2", "--sequence-parallel", *Z3],
 "moe": ["--dp", "4", "--ep", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", *Z3],
 "sel": ["--dp", "4", "--recompute", "selective", *Z3],
}
def run(argv, launch=None):
    t = Trainer(parse_args(BASE + argv), launch=launch)
    try:
        return [r["loss"] for r in t.train().records]
    finally:
        t.close()
def layouts(ps, names, extra):
    out = {}
    for n in names:
        try: out[n] = run(LAY[n] + extra)
        except Exception as e:
            import traceback; out[n] = traceback.format_exc()[-1500:]
    return out
if __name__ == "__main__":
    block = sys.argv[1]; names = sys.argv[2:]
    extra = ["--block", block]
    res = run_distributed(layouts, grid=RankGrid(dp=4), args=(names, extra), timeout_s=60, deadline_s=600)
    for n in names:
        ex = extra + (["--num-query-groups", "2"] if n == "cp" else []) + (["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"] if n == "moe" else [])
        s = run(ex, LaunchEnv())
        r = res[0][n]
        print(n, "OK" if isinstance(r, list) and all(abs(a-b) <= 1e-4*abs(b) for a, b in zip(r, s)) else "MISMATCH", r, s)
