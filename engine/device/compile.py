"""``--compile``: torch.compile every model chunk with the device's backend, caching what the
compiler produces under the run directory so that the next run of the same recipe reuses it.

Backends: Inductor on cpu and cuda. On Ascend, torch_npu's torch.compile backend is TorchAir, whose
user guide positions it for inference graphs only (beta); nothing in torch_npu's documentation
covers a training graph with npu_fusion_attention's backward, so ``--compile`` on an NPU stops at
start-up with one line (``engine.device.chips.COMPILE_ON_NPU``) rather than compile a graph whose
backward has no documented graph mode.

Chunks are compiled in place (``nn.Module.compile``), so they keep their type, their methods
(``shared_embedding_params``, ...) and their parameter names: checkpoints, gradient buckets and the
pipeline see the same modules as without ``--compile``.

Graphs. Every chunk of a rank runs the same code (``GPTChunk.forward``), so Dynamo keeps one list
of compiled entries for all of them: one per chunk (it guards on the chunk's layer range) and grad
mode (training, and evaluation under ``torch.no_grad``). Past Dynamo's recompile limit (8 by
default) a call that needs a new entry runs eagerly, silently: an interleaved rank with five
chunks and ``--eval-interval`` would need ten. Each chunk is compiled with its own limit
(``torch.compile(recompile_limit=...)``, scoped to these calls; the process's setting is left as it
is): ``chunk_recompile_limit``, two entries per chunk plus ``RECOMPILE_MARGIN`` for any other
reason to retrace (a new input shape before Dynamo makes it dynamic), and never below the
process's limit. ``torch.compile`` takes that keyword from torch 2.12 on; before (the 2.11 of a
CUDA 13 machine), the process's ``torch._dynamo.config.recompile_limit`` is raised to it instead
(never lowered): every chunk runs the one ``GPTChunk.forward``, whose entries that limit counts.

Cache. Inductor persists its artifacts (FX graph cache: generated kernels; AOTAutograd cache: the
joint forward/backward graphs) in ``TORCHINDUCTOR_CACHE_DIR``. Inductor reads that variable itself,
lazily, when it first needs the cache, so this module sets it (this one entry point configures the
library for the whole process) to ``<run_dir>/compile_cache`` before anything is compiled, and turns
both caches on. A later run with the same run directory, code, shapes and torch version finds its
graphs there and skips code generation; Dynamo still traces the Python code, which is cheap next to
Inductor. ``torch.compiler.save_cache_artifacts()`` / ``load_cache_artifacts()`` exist in this torch
too, but they serialise the same artifacts into one pickled blob meant for shipping a cache to
another machine; the directory cache already serves "same run directory, next run" and loading a
pickle from a run directory is something this project does not do.

"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from engine.device.chips import COMPILE_ON_NPU
from kernels.signatures import accepts

CACHE_DIRNAME = "compile_cache"
MODES = 2              # grad modes a chunk runs in: training and evaluation
RECOMPILE_MARGIN = 8   # entries beyond chunks x modes (Dynamo's default limit)


def compile_backend(device_type: str):
    """The torch.compile backend for a device type: "inductor" (cpu, cuda)."""
    if device_type in ("cpu", "cuda"):
        return "inductor"
    if device_type == "npu":
        raise ValueError(COMPILE_ON_NPU)
    raise ValueError(f"--compile supports cpu and cuda devices, not {device_type!r}")


def configure_compile_cache(run_dir: str | os.PathLike) -> Path:
    """Point Inductor's on-disk caches at ``run_dir/compile_cache`` and enable them.

    Must run before the first compilation in the process. Returns the cache directory.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    cache = (Path(run_dir) / CACHE_DIRNAME).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return cache


def chunk_recompile_limit(n_chunks: int) -> int:
    """The recompile limit the chunks are compiled with: an entry per chunk and grad mode, plus
    ``RECOMPILE_MARGIN``; never below the process's ``torch._dynamo.config.recompile_limit``."""
    import torch._dynamo.config as dynamo_config
    return max(dynamo_config.recompile_limit, MODES * n_chunks + RECOMPILE_MARGIN)


def compile_chunks(chunks: nn.ModuleList, dev, run_dir: str | os.PathLike) -> nn.ModuleList:
    """Compile each chunk in place with ``dev.type``'s backend and ``chunk_recompile_limit``;
    artifacts go to run_dir's cache.

    ``dev`` is an ``engine.device.runtime.DeviceInfo``. Compilation itself happens lazily, on each chunk's
    first call; the returned ModuleList is ``chunks``.
    """
    backend = compile_backend(dev.type)
    configure_compile_cache(run_dir)
    limits = limit_options(chunk_recompile_limit(len(chunks)))
    for chunk in chunks:
        chunk.compile(backend=backend, **limits)
    return chunks


def limit_options(limit: int, compile_fn=None) -> dict:
    """``torch.compile``'s keyword for a recompile limit of ``limit`` where it takes one (torch >=
    2.12); else the process's limit is raised to ``limit`` and no keyword is passed."""
    import torch._dynamo.config as dynamo_config
    if accepts(compile_fn or torch.compile, "recompile_limit"):
        return {"recompile_limit": limit}
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    return {}
