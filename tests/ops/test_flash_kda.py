"""The opt-in FlashKDA path's gates on a machine without it: it never takes a CPU call, a library that
does not load is an error naming the variable, and the entry point refuses calls it cannot run.
(Its numerics are checked on a GPU: tests/gpu/test_fast_ops.py::test_flash_kda_prefill_matches_reference.)"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.cuda import flash_kda


def test_cpu_tensors_never_take_flash_kda(monkeypatch, tmp_path):
    monkeypatch.setenv(flash_kda.ENV, str(tmp_path / "absent.so"))
    q = torch.zeros(3, 2, 128, dtype=torch.bfloat16)
    assert not flash_kda.flash_kda_applies(q, q, -5.0)       # decided before the library is touched


def test_a_library_that_does_not_load_names_the_variable(monkeypatch, tmp_path):
    bad = tmp_path / "not_a_library.so"
    bad.write_text("not an ELF file")
    monkeypatch.setenv(flash_kda.ENV, str(bad))
    with pytest.raises(RuntimeError, match=f"{flash_kda.ENV}=.*not_a_library.so.*build_flash_kda.sh"):
        flash_kda.flash_kda_library()


def test_unset_means_no_library(monkeypatch):
    monkeypatch.delenv(flash_kda.ENV, raising=False)
    assert flash_kda.flash_kda_library() is None


def test_entry_point_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.delenv(flash_kda.ENV, raising=False)
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KIMIK3_FLASH_KDA"):
        flash_kda.flash_kda_varlen(q, q, q, q, q[..., 0], torch.zeros(2), torch.zeros(256), -5.0,
                                   torch.zeros(1, 2, 128, 128), torch.tensor([0, 4]))
