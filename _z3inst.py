import torch
from engine.config.cli import parse_args
from engine.training.trainer import Trainer
from parallel.state import LaunchEnv
import parallel.dp.zero3_units as zu
BASE = ["--mock-data", "--vocab-size", "128", "--no-progress", "--device", "cpu", "--num-layers", "3",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--precision", "fp32",
        "--train-iters", "1", "--data-parallel-sharding-strategy", "optim_grads_params", "--block", "gpt2"]
t = Trainer(parse_args(BASE), launch=LaunchEnv())
st = t.optimizer.param_gather
units = st.units
print("kept", units.kept, "units", [(type(u.module).__name__, u.needs, u.own) for u in units.units])
log = []
orig_free, orig_gather = st.free, st.gather
def free(ix):
    g = [i for i in ix if st.state[i] != "free"]
    if g: log.append(("free", tuple(g), torch._C._current_graph_task_id() != -1))
    orig_free(ix)
def gather(ix):
    g = [i for i in ix if st.state[i] == "free"]
    orig_gather(ix)
    if g: log.append(("gather", tuple(g), torch._C._current_graph_task_id() != -1, len([i for i in st.gathered if i not in units.kept])))
st.free, st.gather = free, gather
t.train()
for l in log: print(l)
