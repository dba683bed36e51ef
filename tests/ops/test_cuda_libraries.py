"""The opt-in CUDA libraries (``kimik3/ops/cuda``: FlashMLA decode, FlashKDA prefill) on a machine without
them: a CPU call never takes one, a library that does not load is an error naming its variable and build
script, an unset variable means our kernels, and each entry point refuses what it cannot run. (Their
numerics and graph capture are checked on a GPU: tests/gpu/test_fast_ops.py::test_flash_*.)"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.cuda import flash_kda, flash_mla

BF16 = torch.bfloat16


def _mla_operands(block: int = 64):
    return (torch.zeros(2, 4, 512, dtype=BF16), torch.zeros(2, 4, 64, dtype=BF16),
            torch.zeros(3, block, 576, dtype=BF16))


LIBRARIES = {
    "flash_mla": (flash_mla, flash_mla.flash_mla_library, "build_flash_mla.sh",
                  lambda: flash_mla.flash_mla_applies(*_mla_operands())),
    "flash_kda": (flash_kda, flash_kda.flash_kda_library, "build_flash_kda.sh",
                  lambda: flash_kda.flash_kda_applies(torch.zeros(3, 2, 128, dtype=BF16),
                                                      torch.zeros(3, 2, 128, dtype=BF16), -5.0)),
}


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_cpu_tensors_never_take_the_library(name, monkeypatch, tmp_path):
    module, _, _, applies = LIBRARIES[name]
    monkeypatch.setenv(module.ENV, str(tmp_path / "absent.so"))
    assert not applies()                                     # decided before the library is touched


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_a_library_that_does_not_load_names_its_variable(name, monkeypatch, tmp_path):
    module, load, script, _ = LIBRARIES[name]
    bad = tmp_path / f"{name}_not_a_library.so"
    bad.write_text("not an ELF file")
    monkeypatch.setenv(module.ENV, str(bad))
    with pytest.raises(RuntimeError, match=f"{module.ENV}=.*not_a_library.so.*{script}"):
        load()


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_unset_means_our_kernels(name, monkeypatch):
    module, load, _, _ = LIBRARIES[name]
    monkeypatch.delenv(module.ENV, raising=False)
    assert load() is None


def test_flash_mla_refuses_a_cache_of_other_blocks(monkeypatch):
    monkeypatch.delenv(flash_mla.ENV, raising=False)
    q_lat, q_pe, cache = _mla_operands(block=16)
    with pytest.raises(ValueError, match="KIMIK3_FLASH_MLA.*cache \\[blocks, 64, 576\\]"):
        flash_mla.flash_mla_decode(q_lat, q_pe, cache, torch.zeros(2, 1, dtype=torch.int32),
                                   torch.ones(2, dtype=torch.int32), 0.1)


def test_flash_kda_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.delenv(flash_kda.ENV, raising=False)
    q = torch.zeros(4, 2, 128, dtype=BF16)
    with pytest.raises(ValueError, match="KIMIK3_FLASH_KDA"):
        flash_kda.flash_kda_varlen(q, q, q, q, q[..., 0], torch.zeros(2), torch.zeros(256), -5.0,
                                   torch.zeros(1, 2, 128, 128), torch.tensor([0, 4]))
