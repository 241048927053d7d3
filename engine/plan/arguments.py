"""``python -m engine.plan``'s arguments, checked before any work: one line (ValueError naming the
flag) for a missing or absurd cluster size, a size, count or rate that is not positive, and an input
file (--config, --calibrate, --calibrate-links) that is missing, a directory or unreadable."""
from __future__ import annotations

import argparse
import math
import os

from engine.plan.model import MAX_DEVICES

SIZE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
             "global_batch_size", "ffn_hidden_size", "micro_batch_size", "num_experts",
             "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")


def _readable(flag: str, path: str) -> None:
    """One line when an input file named by ``flag`` cannot be read."""
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path}: not readable")


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any work: sizes, counts, rates and input files (ValueError, one
    line, naming the flag)."""
    if args.devices is None:
        raise ValueError("--devices N is required: the cluster's total devices")
    if not 1 <= args.devices <= MAX_DEVICES:
        raise ValueError(f"--devices must be between 1 and {MAX_DEVICES:,}, got {args.devices}")
    if args.devices_per_node is not None and not 1 <= args.devices_per_node <= args.devices:
        raise ValueError(f"--devices-per-node must be between 1 and --devices {args.devices}, got "
                         f"{args.devices_per_node}")
    for key in SIZE_KEYS:
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    for key in ("intra_node_gbps", "inter_node_gbps", "peak_tflops", "memory_gb", "fp8_peak_tflops",
                "host_link_gbps", "host_memory_gbps", "host_memory_gb"):
        value = getattr(args, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{key.replace('_', '-')} must be a positive number, got {value}")
    for key in ("achievable_fraction", "fp8_achievable_fraction"):
        frac = getattr(args, key)
        if frac is not None and not (math.isfinite(frac) and 0 < frac <= 1):
            raise ValueError(f"--{key.replace('_', '-')} must be in (0, 1], got {frac}")
    if not (math.isfinite(args.offload_fraction) and 0 < args.offload_fraction <= 1):
        raise ValueError(f"--optimizer-offload-fraction must be in (0, 1], got {args.offload_fraction}")
    for flag, path in (("--config", args.config), ("--calibrate", args.calibrate),
                       ("--calibrate-links", args.calibrate_links)):
        if path is not None:
            _readable(flag, path)
