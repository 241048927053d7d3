"""The device runtime's own report of host waits: CUDA's synchronizing-operation warnings.

``torch.cuda.set_sync_debug_mode("warn")`` makes the CUDA runtime warn on every operation that
synchronizes the host with the device (scalar reads, blocking copies in either direction,
``nonzero`` and the ops built on it, ...). ``cuda_sync_warnings(counter)`` turns each such warning
into one count of ``counter`` (a ``SyncCounter``: engine/device/syncs.py) for the block, and
shows no warning; a wait the counter already counts through a patched tensor method (``item``,
``tolist``) or one the engine counts itself (``DeviceClock``) is not counted again. Warnings
raised in the autograd engine's device threads reach the thread that ran ``backward``, where
they are counted like the forward's.

This is the cross-check of the dispatch-mode count (engine/device/sync_ops.py):
``benchmarks.device_check`` runs the same steps under each and prints both. The mode is
process-wide; it is restored when the block ends.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

SYNC_WARNING = "synchronizing CUDA operation"   # c10/cuda/CUDAFunctions.cpp's message
NAME = "cuda synchronizing operation"


@contextlib.contextmanager
def cuda_sync_warnings(counter):
    """Count CUDA's synchronizing-operation warnings into ``counter`` inside the block."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return shown(message, category, filename, lineno, file, line)
            if not counter._inside:
                counter.count(NAME)
            return None
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode(previous)
