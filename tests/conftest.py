import os
import sys

import pytest
import torch

# Without CUDA our Triton kernels run on CPU tensors through Triton's interpreter. The variable must be
# set before ``triton.jit`` wraps a kernel, and any test module (tests/gpu among them, collected before
# tests/ops) may import a kernel module, so it is set here, before the first test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kimik3.testing import make_tiny_checkpoint  # noqa: E402

# tiny ops: one thread avoids OpenMP spin-waiting on the shared 2-core CI machine
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Tiny random checkpoints in the release layouts, keyed by architecture."""
    paths = {}
    for arch in ("kimi_k3", "kimi_linear"):
        paths[arch] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=1)
    return paths


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny K3 tokenizer (2048 base tokens + K3's special-token table)."""
    from kimik3.tokenizer_build import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny_k3_tokenizer")
    build_tiny_tokenizer(d, base_vocab_size=2048, seed=0)
    return d


@pytest.fixture(scope="session")
def tok(tiny_dir):
    from kimik3.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir)


def pytest_runtest_logreport(report):
    """With KIMIK3_INSTAFAIL=1 (the GPU device calls), a failure's report is written the moment it
    happens, so a run cut off by its time limit still leaves it in the log."""
    if report.failed and os.environ.get("KIMIK3_INSTAFAIL"):
        print(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n", file=sys.__stderr__, flush=True)


@pytest.fixture
def kernel_options():
    """``kernel_options(KernelOptions(...))`` and/or ``kernel_options(field=value, ...)`` (``KernelOptions`` or
    ``KernelTuning`` fields, on top of the options in force): the rest of the test runs under options it
    constructed (``kimik3.ops.options.use_kernel_options``), restored when it ends."""
    import contextlib
    import dataclasses

    from kimik3.ops.options import KernelOptions, use_kernel_options
    from kimik3.ops.options import kernel_options as current
    stack = contextlib.ExitStack()
    top_fields = {f.name for f in dataclasses.fields(KernelOptions)} - {"tuning"}

    def use(options=None, **changes):
        opts = options or current()
        top = {k: v for k, v in changes.items() if k in top_fields}
        tuning = {k: v for k, v in changes.items() if k not in top_fields}
        opts = dataclasses.replace(opts, **top).tuned(**tuning)
        return stack.enter_context(use_kernel_options(opts))
    yield use
    stack.close()
