import pytest
import torch

from kimik3.testing import make_tiny_checkpoint

# tiny ops: one thread avoids OpenMP spin-waiting on the shared 2-core CI machine
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Tiny random checkpoints in the release layouts, keyed by architecture."""
    paths = {}
    for arch in ("kimi_k3", "kimi_linear"):
        paths[arch] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=1)
    return paths
