"""The opt-in FlashMLA decode's gates on a machine without it: it never takes a CPU call, a library
that does not load is an error naming the variable, and the entry point refuses what it cannot run.
(Its numerics and graph capture are checked on a GPU: tests/gpu/test_fast_ops.py::test_flash_mla_decode*.)"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.cuda import flash_mla


def _operands(block: int = 64):
    q_lat = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    q_pe = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, block, 576, dtype=torch.bfloat16)
    return q_lat, q_pe, cache


def test_cpu_tensors_never_take_flash_mla(monkeypatch, tmp_path):
    monkeypatch.setenv(flash_mla.ENV, str(tmp_path / "absent.so"))
    assert not flash_mla.flash_mla_applies(*_operands())       # decided before the library is touched


def test_a_library_that_does_not_load_names_the_variable(monkeypatch, tmp_path):
    bad = tmp_path / "not_a_library.so"
    bad.write_text("not an ELF file")
    monkeypatch.setenv(flash_mla.ENV, str(bad))
    with pytest.raises(RuntimeError, match=f"{flash_mla.ENV}=.*not_a_library.so.*build_flash_mla.sh"):
        flash_mla.flash_mla_library()


def test_entry_point_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.delenv(flash_mla.ENV, raising=False)
    q_lat, q_pe, cache = _operands(block=16)
    with pytest.raises(ValueError, match="KIMIK3_FLASH_MLA.*cache \\[blocks, 64, 576\\]"):
        flash_mla.flash_mla_decode(q_lat, q_pe, cache, torch.zeros(2, 1, dtype=torch.int32),
                                   torch.ones(2, dtype=torch.int32), 0.1)
