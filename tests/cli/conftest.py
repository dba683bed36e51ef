import pytest

from kimik3.testing import make_tiny_checkpoint
from kimik3.tokenizer_build import build_tiny_tokenizer, model_token_ids


@pytest.fixture(scope="session")
def tiny_tokenizer_ckpt(tmp_path_factory):
    """A tiny K3 test checkpoint (not the embedded one) with its own tokenizer."""
    path = tmp_path_factory.mktemp("cli_ckpt")
    ids = model_token_ids(512)
    make_tiny_checkpoint(path, "kimi_k3", seed=7, vocab_size=ids["vocab_size"], bos=ids["bos_token_id"],
                         eos=ids["eos_token_id"], pad=ids["pad_token_id"], media=ids["media_placeholder_token_id"],
                         vision=False)
    build_tiny_tokenizer(path, base_vocab_size=512, seed=1)
    return path
