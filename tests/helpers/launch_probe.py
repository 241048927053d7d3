"""Run under torchrun by tests/engine/training/test_launch.py: set up the grid as the trainer does and write what
this rank sees (its node, LOCAL_RANK binding and TP/DP/PP groups) to a JSON file per rank."""
import json
import os
import sys


from engine.device.runtime import setup_device
from engine.training.launch import exit_now
from parallel.grid.launch import LaunchEnv
from parallel.grid.state import ParallelState
from parallel.grid.topology import RankGrid


def main(out_dir: str, tp: int, pp: int) -> None:
    launch = LaunchEnv.from_env()
    dev = setup_device("cpu", launch.local_rank)
    grid = RankGrid(tp=tp, pp=pp, dp=launch.world_size // (tp * pp))
    ps = ParallelState.initialize(grid, dev.device, dev.backend, launch, timeout_s=60)
    info = {"rank": ps.rank, "local_rank": launch.local_rank, "node": int(os.environ["GROUP_RANK"]),
            "bound_to": ps.local_rank, "local_world_size": launch.local_world_size,
            "tp_group": list(ps.tp_group.ranks),
            "dp_group": list(ps.dp_group.ranks),
            "pp_group": list(ps.pp_group.ranks)}
    with open(os.path.join(out_dir, f"rank{ps.rank}.json"), "w") as fh:
        json.dump(info, fh)
    ps.destroy()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    exit_now(0)
