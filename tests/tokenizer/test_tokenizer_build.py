import pytest

from kimik3.tokenizer import load_tokenizer, read_tiktoken_model
from kimik3.tokenizer_build import build_tiny_tokenizer, special_token_ids


def test_build_is_deterministic(tmp_path, tiny_dir):
    build_tiny_tokenizer(tmp_path / "again", base_vocab_size=2048, seed=0)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_dir / name).read_bytes()


def test_seed_and_size_change_the_vocab(tmp_path, tiny_dir):
    build_tiny_tokenizer(tmp_path / "s1", base_vocab_size=2048, seed=1)
    assert (tmp_path / "s1" / "tiktoken.model").read_bytes() != (tiny_dir / "tiktoken.model").read_bytes()
    build_tiny_tokenizer(tmp_path / "small", base_vocab_size=300, seed=0)
    tok = load_tokenizer(tmp_path / "small")
    assert tok.num_base_tokens == 300 and tok.vocab_size == 556
    assert tok.special_tokens["<|open|>"] == 303 == special_token_ids(300)["<|open|>"]
    assert tok.decode(tok.encode("small vocab 😀")) == "small vocab 😀"


def test_vocab_is_byte_level_and_merges_are_learned(tiny_dir):
    ranks = read_tiktoken_model(tiny_dir / "tiktoken.model")
    assert len(ranks) == 2048
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert b" the" in ranks and b"message" in ranks  # frequent corpus words became single tokens


def test_tiny_tokenizer_compresses(tok):
    text = "The user asked about the weather in Paris and the assistant will answer."
    assert len(tok.encode(text)) < len(text) / 3


@pytest.mark.parametrize("bad", [100, 255, 9000, "2048"])
def test_bad_size(tmp_path, bad):
    with pytest.raises(ValueError, match="base_vocab_size must be an int"):
        build_tiny_tokenizer(tmp_path, base_vocab_size=bad)


def test_bad_format(tmp_path):
    with pytest.raises(ValueError, match="chat_format must be one of"):
        build_tiny_tokenizer(tmp_path, chat_format="llama")
