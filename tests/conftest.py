import gc
import os

import pytest
import torch

# The whole suite runs under HCCL's rules (Atlas A2/A3): every collective the engine issues on gloo
# is checked against what HCCL accepts (parallel/runtime/backend_rules.py). Spawned ranks and
# torchrun workers inherit the variable; the CLI takes it as the default of --backend-rules.
os.environ.setdefault("GRIDTRON_BACKEND_RULES", "hccl")

# One intra-op thread in this process and in every process it starts (spawned ranks, the CLI and
# torchrun runs): the suite's matrices are tiny, and OpenMP threads that spin while another process
# holds the core made a 20-step serial run take 55 s instead of 0.7 s on a loaded 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Inductor's CPU kernels in scalar C++ (no at::vec): the suite checks what is compiled (graphs,
# breaks, values against eager), not the vector width, and g++ builds a scalar kernel in about
# half the time of a vectorized one (the compiled-MoE file: 93 s -> 62 s). Read by Inductor when
# its config is first imported, here and in every process the suite starts; `--compile` outside
# the suite keeps Inductor's default.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


@pytest.fixture(scope="module", autouse=True)
def collect_after_module():
    """Trainers hold their process groups in reference cycles; collecting after each module ends
    their gloo threads instead of letting them pile up in this process."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One cache directory for the built-in corpus, shared by every test of the session."""
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.fixture
def stream_checker():
    """The stream-order checker (parallel/runtime/stream_check.py), installed and active on the
    test's thread for the whole test; a violation it recorded fails the test at teardown."""
    from parallel.runtime.stream_check import StreamChecker
    checker = StreamChecker()
    with checker.installed():
        yield checker
    checker.check()


# The files that take a minute or more of a worker (measured with --durations), run first: with
# two workers taking one file at a time, a long file started last leaves the other worker idle.
HEAVY_FIRST = (
    "tests/engine/device/test_compile_moe.py",
    "tests/benchmarks/test_device_check.py",
    "tests/equivalence/test_stream_matrix.py",
    "tests/parallel/dp/test_zero3.py",
    "tests/equivalence/test_equivalence_cp.py",
    "tests/engine/device/test_compile.py",
    "tests/parallel/tensor_parallel/test_tp_overlap_train.py",
    "tests/equivalence/test_equivalence_moe_layouts.py",
    "tests/engine/dryrun/test_dryrun.py",
    "tests/equivalence/test_equivalence_zb.py",
    "tests/engine/training/test_fp8_train.py",
    "tests/engine/training/test_fp8_moe_train.py",
    "tests/equivalence/test_equivalence_moe_etp.py",
    "tests/engine/fuzz/test_fuzz.py",
    "tests/equivalence/test_equivalence_dp.py",
    "tests/equivalence/test_equivalence_packed.py",
    "tests/engine/tools/test_preflight.py",
    "tests/parallel/dp/test_param_gather_order.py",
    "tests/engine/checkpoint/test_checkpoint_reshard.py",
    "tests/engine/dryrun/test_dryrun_moe.py",
)


def pytest_collection_modifyitems(config, items):
    """Heaviest files first (HEAVY_FIRST's order), the rest in collection order; every worker
    sorts the same way, as pytest-xdist requires."""
    root = config.rootpath
    missing = [path for path in HEAVY_FIRST if not (root / path).exists()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py HEAVY_FIRST names missing files: {missing}")
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))
