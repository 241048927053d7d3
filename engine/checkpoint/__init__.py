"""Sharded, resharding checkpoints: every rank writes the slices it owns, any layout reads them back.

- ``index.py``: the on-disk format (index.json, safetensors shards, ``latest``), verification,
  ``inspect``;
- ``tensor_reader.py``: any box of a logical tensor read back from the pieces that overlap it;
- ``specs.py``: where each local parameter sits in the logical tensors;
- ``writer.py``: ``save_checkpoint`` (atomic tmp directory, rename, ``latest``);
- ``async_writer.py``: saves at step boundaries, in a background thread with ``--async-save``
  (completion agreed at later boundaries, published by the writer's ``publish``);
- ``reader.py``: ``load_checkpoint`` under any layout;
- ``resume.py``: where a run starts (``--load``, or this run's unfinished run in ``--save``), and the
  refusal of another run's checkpoints there (``--overwrite`` moves them aside);
- ``export.py``: ``python -m engine.export`` to Hugging Face transformers;
- ``import_hf.py``: ``python -m engine.import_hf``, a transformers GPT-2, Llama, Qwen3, Mixtral or
  Qwen3-MoE in.

``python -m engine.checkpoint inspect DIR`` prints a checkpoint. See docs/checkpoints.md.
"""
from __future__ import annotations

from engine.checkpoint.index import (CheckpointError, has_checkpoint, inspect, intact_hint,
                                     read_index, resolve, saved_step, verify)
from engine.checkpoint.tensor_reader import TensorReader
from engine.checkpoint.reader import load_checkpoint, load_model_params
from engine.checkpoint.specs import ParamSpec, param_specs
from engine.checkpoint.writer import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "has_checkpoint", "saved_step", "CheckpointError",
           "ParamSpec", "param_specs", "load_model_params", "inspect", "main", "TensorReader",
           "intact_hint", "read_index", "resolve", "verify"]


def main(argv: list[str] | None = None) -> int:
    from engine.base import ToolParser, os_error_text, run_tool
    parser = ToolParser(prog="python -m engine.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print step, layout and tensors; verify checksums").add_argument("dir")
    return run_tool(lambda: inspect(parser.parse_args(argv).dir),
                    (CheckpointError, lambda e: f"checkpoint error: {e}", 1),
                    (OSError, lambda e: f"checkpoint error: {os_error_text(e)}", 1))
