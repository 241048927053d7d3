"""Sharded, resharding checkpoints: every rank writes the slices it owns, any layout reads them back.

- ``index.py``: the on-disk format (index.json, safetensors shards, ``latest``), verification, the
  box reader, ``inspect``;
- ``specs.py``: where each local parameter sits in the logical tensors;
- ``writer.py``: ``save_checkpoint`` (atomic tmp directory, rename, ``latest``);
- ``async_writer.py``: saves at step boundaries, in a background thread with ``--async-save``
  (completion agreed at later boundaries, published by the writer's ``publish``);
- ``reader.py``: ``load_checkpoint`` under any layout;
- ``resume.py``: where a run starts (``--load``, or the unfinished run in ``--save``);
- ``export.py``: ``python -m engine.export`` to Hugging Face transformers.

``python -m engine.checkpoint inspect DIR`` prints a checkpoint. See docs/checkpoints.md.
"""
from __future__ import annotations

import argparse
import sys

from engine.checkpoint.index import (CheckpointError, TensorReader, has_checkpoint, inspect,
                                     intact_hint, read_index, resolve, saved_step, verify)
from engine.checkpoint.reader import load_checkpoint, load_model_params
from engine.checkpoint.specs import ParamSpec, param_specs
from engine.checkpoint.writer import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "has_checkpoint", "saved_step", "CheckpointError",
           "ParamSpec", "param_specs", "load_model_params", "inspect", "main", "TensorReader",
           "intact_hint", "read_index", "resolve", "verify"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print step, layout and tensors; verify checksums").add_argument("dir")
    args = parser.parse_args(argv)
    try:
        return inspect(args.dir)
    except CheckpointError as exc:
        print(f"gridtron: checkpoint error: {exc}", file=sys.stderr)
        return 1
