import pytest

from kimik3.tokenizer import load_tokenizer
from kimik3.tokenizer_build import build_tiny_tokenizer


@pytest.fixture(scope="session")
def linear_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_linear")
    build_tiny_tokenizer(d, base_vocab_size=700, seed=1, chat_format="kimi_linear")
    return load_tokenizer(d)
