import pytest


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One cache directory for the built-in corpus, shared by every test of the session."""
    return str(tmp_path_factory.mktemp("corpus_cache"))
