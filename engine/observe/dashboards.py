"""Dashboards: TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Global rank 0 sends the step's scalars every ``--log-interval`` steps, and the validation loss and
the straggler figures on every step that has them (``OFF_INTERVAL``: the straggler report the run
ends on lands in its last step's record, which need not be an interval step). Tags are the
metrics' JSONL keys grouped by what they measure (``SCALARS``); a key whose value is null on a step
(the bubble without PP, MFU without a known peak) is not sent. TensorBoard's ``SummaryWriter`` needs the ``tensorboard`` package; wandb is optional
(``pip install wandb``; ``--wandb-mode offline`` writes the run locally, ``wandb sync`` uploads it).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

SCALARS = {  # metrics key -> dashboard tag
    "loss": "train/loss",
    "valid_loss": "valid/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "throughput/tokens_per_s",
    "tflops_per_device": "throughput/tflops_per_device",
    "mfu": "throughput/mfu",
    "hfu": "throughput/hfu",
    "step_time_s": "throughput/step_time_s",
    "bubble_theoretical": "pipeline/bubble_theoretical",
    "bubble_simulated": "pipeline/bubble_simulated",
    "bubble_measured": "pipeline/bubble_measured",
    "bubble_simulated_compute": "pipeline/bubble_simulated_compute",
    "time_pp_exposed_s": "comm/time_pp_exposed_s",
    "time_dp_exposed_s": "comm/time_dp_exposed_s",
    "time_tp_exposed_s": "comm/time_tp_exposed_s",
    "time_zero_gather_exposed_s": "comm/time_zero_gather_exposed_s",
    "dp_comm_bytes": "comm/dp_comm_bytes",
    "dp_comm_wire_bytes": "comm/dp_comm_wire_bytes",
    "tp_comm_bytes": "comm/tp_comm_bytes",
    "cp_comm_bytes": "comm/cp_comm_bytes",
    "pp_comm_bytes": "comm/pp_comm_bytes",
    "ep_comm_bytes": "comm/ep_comm_bytes",
    "moe_aux_loss": "moe/aux_loss",
    "moe_z_loss": "moe/z_loss",
    "moe_load_imbalance": "moe/load_imbalance",
    "moe_tokens_dropped": "moe/tokens_dropped",
    "peak_memory_bytes": "memory/peak_memory_bytes",
    "straggler_rank": "stragglers/straggler_rank",
    "straggler_ratio": "stragglers/straggler_ratio",
}


def missing_packages(log_cfg) -> list[str]:
    """The dashboards asked for whose package is not installed, as one-line fixes."""
    out = []
    if log_cfg.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        out.append("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                   "(or pip install -e .[tensorboard])")
    if log_cfg.wandb_project and log_cfg.wandb_mode != "disabled" and \
            importlib.util.find_spec("wandb") is None:
        out.append("--wandb-project needs the wandb package: pip install wandb (or pip install -e "
                   ".[wandb]), or drop --wandb-project")
    return out


# the tags sent on a step off the --log-interval too, where the record holds them
OFF_INTERVAL = frozenset(SCALARS[k] for k in ("valid_loss", "straggler_rank", "straggler_ratio"))
# metrics keys whose value is a list: one tag per entry, TAG/i
LISTS = {"moe_expert_load": "moe/expert_load"}


def scalars(record: dict) -> dict[str, float]:
    out = {tag: float(record[key]) for key, tag in SCALARS.items()
           if record.get(key) is not None and not isinstance(record[key], bool)}
    for key, tag in LISTS.items():
        for i, v in enumerate(record.get(key) or ()):
            out[f"{tag}/{i}"] = float(v)
    return out


class Dashboards:
    """The dashboards of one run (rank 0 only; elsewhere every method does nothing). They are
    opened at the first record, once the run's first step is done: a run that fails before writes
    no event file and starts no wandb run."""

    def __init__(self, cfg, enabled: bool, start_step: int = 0):
        self.interval = cfg.log.log_interval
        self.tb = self.wandb = None
        self._pending = (cfg, start_step) if enabled else None

    def _open(self) -> None:
        cfg, start_step = self._pending
        self._pending = None
        log = cfg.log
        if log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(log.tensorboard_dir, exist_ok=True)
            # the events of earlier runs after the step this run starts from are purged, as its
            # metrics file drops their records: a resumed run's from the step after the resumed
            # one (a crashed attempt's), a fresh run's from step 1 (an earlier run's, all of them)
            self.tb = SummaryWriter(log.tensorboard_dir, purge_step=start_step + 1)
        if log.wandb_project and log.wandb_mode != "disabled":
            import wandb
            save_dir = log.wandb_save_dir or log.run_dir or "."
            os.makedirs(save_dir, exist_ok=True)
            config = dataclasses.asdict(cfg)
            self.wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name, dir=save_dir,
                                    mode=log.wandb_mode, config=config)

    def log(self, record: dict) -> None:
        if self._pending is not None:
            self._open()
        step = record["step"]
        values = scalars(record)
        if step % self.interval:
            values = {k: v for k, v in values.items() if k in OFF_INTERVAL}
        if not values:
            return
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        self._pending = None
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
