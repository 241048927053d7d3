import os

import pytest

# The whole suite runs under HCCL's rules (Atlas A2/A3): every collective the engine issues on gloo
# is checked against what HCCL accepts (parallel/backend_rules.py). Spawned ranks and torchrun
# workers inherit the variable; the CLI takes it as the default of --backend-rules.
os.environ.setdefault("GRIDTRON_BACKEND_RULES", "hccl")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One cache directory for the built-in corpus, shared by every test of the session."""
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.fixture
def stream_checker():
    """The stream-order checker (parallel/stream_check.py), installed and active on the test's
    thread for the whole test; a violation it recorded fails the test at teardown."""
    from parallel.stream_check import StreamChecker
    checker = StreamChecker()
    with checker.installed():
        yield checker
    checker.check()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny matrices: faster, and fair to a shared machine
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
