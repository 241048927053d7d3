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
