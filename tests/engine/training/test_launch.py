"""A two-node launch on this machine: two torchrun agents (--nnodes 2, 2 processes each) meeting at a
c10d rendezvous on 127.0.0.1; and one torchrun job whose ranks were started with different flags."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine.fuzz.pool import free_port

ROOT = str(Path(__file__).resolve().parents[3])


def test_two_node_launch_keeps_tp_inside_a_node(tmp_path):
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "probe",
         "--max-restarts", "0", os.path.join(ROOT, "tests", "helpers", "launch_probe.py"), str(tmp_path), "2", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = [a.communicate(timeout=180)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(outputs)
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    node_of = {i["rank"]: i["node"] for i in infos}
    for info in infos:
        assert info["local_world_size"] == 2
        assert info["bound_to"] == info["local_rank"] == info["rank"] % 2  # LOCAL_RANK, not RANK
        assert len({node_of[r] for r in info["tp_group"]}) == 1, info  # TP inside one node
        assert len({node_of[r] for r in info["dp_group"]}) == 2, info  # DP across the nodes
    assert sorted(tuple(i["tp_group"]) for i in infos) == [(0, 1), (0, 1), (2, 3), (2, 3)]


def test_ranks_with_different_model_flags_each_say_so_under_torchrun(tmp_path):
    """One torchrun job whose rank 1 was given another --num-layers: every rank prints the one line
    naming the flag and the ranks that differ (the first worker to exit gets the others terminated
    by the agent: none may leave before all have said it), and exits 2; nothing else on stderr."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               GRIDTRON_TEST_RANK_ARGS=json.dumps({"1": ["--num-layers", "4"]}))
    args = ["--mock-data", "--vocab-size", "300", "--no-progress", "--num-layers", "2", "--hidden-size",
            "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "1", "--timeout-s", "60"]
    run = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                          "--tee", "3", "--log-dir", str(tmp_path / "logs"),
                          "-m", "tests.helpers.fault_worker", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    line = ("gridtron: configuration error: ranks started with different configurations: rank 1 has "
            "--num-layers 4 (rank 0: 2); start every rank with the same flags and recipe")
    workers = sorted(ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("[default"))
    assert workers == [f"[default0]:{line}", f"[default1]:{line}"], run.stderr[-3000:]
    assert run.returncode != 0
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", run.stderr)
    assert codes and set(codes) == {"2"}, run.stderr[-3000:]


def test_ctrl_c_outside_the_steps_is_one_line_and_130(monkeypatch, capsys):
    """SIGINT before the training steps (building, loading) or after them ends with one line and
    exit 130, not a traceback; during the steps the trainer stops cleanly (test_checkpoint_async)."""
    import engine.training.launch as launch

    def interrupted(argv=None):
        raise KeyboardInterrupt

    codes = []
    monkeypatch.setattr(launch, "main", interrupted)
    monkeypatch.setattr(launch, "exit_now", codes.append)
    monkeypatch.delenv("RANK", raising=False)
    launch.run_and_exit([])
    assert codes == [130]
    assert capsys.readouterr().err == ("gridtron: interrupted (SIGINT) outside the training steps; "
                                       "nothing was saved by this run after its last checkpoint\n")
