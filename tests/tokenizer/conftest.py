import pytest

from kimik3.tokenizer import load_tokenizer
from kimik3.tokenizer_build import build_tiny_tokenizer

BASE = 2048


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_k3")
    build_tiny_tokenizer(d, base_vocab_size=BASE, seed=0)
    return d


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)
