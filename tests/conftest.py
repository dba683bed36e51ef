import pytest
import torch

from kimik3.testing import make_tiny_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Tiny random checkpoints in the release layouts, keyed by architecture."""
    paths = {}
    for arch in ("kimi_k3", "kimi_linear"):
        paths[arch] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=1)
    return paths
