"""``--compile``: torch.compile every model chunk with the device's backend, caching what the
compiler produces under the run directory so that the next run of the same recipe reuses it.

Backends: Inductor on cpu and cuda; on Ascend, TorchAir's NPU backend
(``torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())``), which lowers the FX graph
to an Ascend IR graph. torchair is imported only on that path.

Chunks are compiled in place (``nn.Module.compile``), so they keep their type, their methods
(``shared_embedding_params``, ...) and their parameter names: checkpoints, gradient buckets and the
pipeline see the same modules as without ``--compile``.

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

TorchAir's own compile cache (``torchair.inference.cache_compile``) is documented for inference only
and excludes graphs with random-number ops such as dropout, so on NPU a training run recompiles its
graphs; the Inductor variables are still set, harmlessly.
"""
from __future__ import annotations

import os
from pathlib import Path

from torch import nn

CACHE_DIRNAME = "compile_cache"
BACKEND_NAMES = {"cpu": "inductor", "cuda": "inductor", "npu": "torchair npu backend"}


def compile_backend(device_type: str):
    """The torch.compile backend for a device type: "inductor" or TorchAir's NPU backend object."""
    if device_type in ("cpu", "cuda"):
        return "inductor"
    if device_type == "npu":
        try:
            import torchair  # only present with the npu extra on an Ascend machine
        except ImportError as exc:
            raise RuntimeError("--compile on NPU needs torchair (installed with torch_npu's CANN "
                               "toolkit); install it or run without --compile") from exc
        config = torchair.CompilerConfig()
        return torchair.get_npu_backend(compiler_config=config)
    raise ValueError(f"--compile supports cpu, cuda and npu devices, not {device_type!r}")


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


def compile_chunks(chunks: nn.ModuleList, dev, run_dir: str | os.PathLike) -> nn.ModuleList:
    """Compile each chunk in place with ``dev.type``'s backend; artifacts go to run_dir's cache.

    ``dev`` is an ``engine.device.runtime.DeviceInfo``. Compilation itself happens lazily, on each chunk's
    first call; the returned ModuleList is ``chunks``.
    """
    backend = compile_backend(dev.type)
    configure_compile_cache(run_dir)
    for chunk in chunks:
        chunk.compile(backend=backend)
    return chunks
