"""The opt-in CUDA libraries (``kimik3/ops/cuda``: FlashMLA decode, FlashKDA prefill) on a machine without
them: a CPU call never takes one, a library that does not load is an error naming its option and build
script, an unset option means our kernels, and each entry point refuses what it cannot run. (Their
numerics and graph capture are checked on a GPU: tests/gpu/test_fast_ops.py::test_flash_*.)"""

from __future__ import annotations

import re

import pytest
import torch

from kimik3.ops.cuda import flash_kda, flash_mla
from kimik3.ops.options import KernelOptions

BF16 = torch.bfloat16


def _mla_operands(block: int = 64):
    return (torch.zeros(2, 4, 512, dtype=BF16), torch.zeros(2, 4, 64, dtype=BF16),
            torch.zeros(3, block, 576, dtype=BF16))


LIBRARIES = {
    "flash_mla": (flash_mla, flash_mla.flash_mla_library, "kimik3 build-kernels",
                  lambda: flash_mla.flash_mla_applies(*_mla_operands())),
    "flash_kda": (flash_kda, flash_kda.flash_kda_library, "kimik3 build-kernels",
                  lambda: flash_kda.flash_kda_applies(torch.zeros(3, 2, 128, dtype=BF16),
                                                      torch.zeros(3, 2, 128, dtype=BF16), -5.0)),
}


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_cpu_tensors_never_take_the_library(name, kernel_options, tmp_path):
    kernel_options(KernelOptions(**{name: str(tmp_path / "absent.so")}))
    _, _, _, applies = LIBRARIES[name]
    assert not applies()                                     # decided before the library is touched


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_a_library_that_does_not_load_names_its_option(name, kernel_options, tmp_path):
    module, load, script, _ = LIBRARIES[name]
    bad = tmp_path / f"{name}_not_a_library.so"
    bad.write_text("not an ELF file")
    kernel_options(KernelOptions(**{name: str(bad)}))
    with pytest.raises(RuntimeError, match=f"--{name.replace('_', '-')} / {module.ENV} = .*not_a_library.so.*{script}"):
        load()


def test_a_flash_mla_library_without_its_schedule_entry_point_is_refused(kernel_options, tmp_path):
    """A library built from an older shim (the schedule inside the decode, no ``kimik3_flash_mla_schedule``) would
    run decodes on a schedule nobody computed: loading it is an error that says to rebuild it."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src = tmp_path / "old_shim.c"
    src.write_text("int kimik3_flash_mla_sm_parts(int h, int s) { return 1; }\n"
                   "int kimik3_flash_mla_meta_ints(void) { return 8; }\n"
                   "int kimik3_flash_mla_decode(void) { return 0; }\n")
    lib = tmp_path / "libold_flash_mla.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    kernel_options(KernelOptions(flash_mla=str(lib)))
    with pytest.raises(RuntimeError, match="built before its schedule had its own entry point: rebuild it with "
                                           "kimik3 build-kernels"):
        flash_mla.flash_mla_library()


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_unset_means_our_kernels(name, kernel_options):
    _, load, _, _ = LIBRARIES[name]
    kernel_options(KernelOptions())
    assert load() is None


def test_flash_mla_refuses_a_cache_of_other_blocks(kernel_options):
    kernel_options(KernelOptions())
    q_lat, q_pe, cache = _mla_operands(block=16)
    with pytest.raises(ValueError, match="KIMIK3_FLASH_MLA.*cache \\[blocks, 64, 576\\]"):
        flash_mla.flash_mla_decode(q_lat, q_pe, cache, torch.zeros(2, 1, dtype=torch.int32),
                                   torch.ones(2, dtype=torch.int32), 0.1)


def test_flash_kda_refuses_what_it_cannot_run(kernel_options):
    kernel_options(KernelOptions())
    q = torch.zeros(4, 2, 128, dtype=BF16)
    with pytest.raises(ValueError, match="KIMIK3_FLASH_KDA"):
        flash_kda.flash_kda_varlen(q, q, q, q, q[..., 0], torch.zeros(2), torch.zeros(256), -5.0,
                                   torch.zeros(1, 2, 128, 128), torch.tensor([0, 4]))


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"dtype": torch.float16}, "runs in torch.float16"),
    ({"block": 16}, "16-token blocks.*--block-size 64"),
    ({"capability": (10, 0)}, "sm_100.*Hopper"),
    ({"rope": 32}, "512 \\+ 32 wide"),
])
def test_flash_mla_says_why_it_passes_a_decode_over(change, reason):
    dtype, block = change.get("dtype", BF16), change.get("block", 64)
    q_lat = torch.zeros(2, 4, 512, dtype=dtype)
    q_pe = torch.zeros(2, 4, change.get("rope", 64), dtype=dtype)
    cache = torch.zeros(3, block, 576, dtype=dtype)
    got = flash_mla.refusal(q_lat, q_pe, cache, change.get("capability", (9, 0)))
    assert (got is None) if reason is None else re.search(reason, got), got


@pytest.mark.parametrize("lower_bound, dtype, dim, reason", [
    (-5.0, BF16, 128, None),
    (None, BF16, 128, "softplus form"),
    (-5.0, torch.float16, 128, "runs in torch.float16"),
    (-5.0, BF16, 64, "head dims are 64"),
])
def test_flash_kda_says_why_it_passes_a_call_over(lower_bound, dtype, dim, reason):
    q = torch.zeros(3, 2, dim, dtype=dtype)
    got = flash_kda.refusal(q, q, lower_bound)
    assert (got is None) if reason is None else re.search(reason, got), got


def test_a_named_library_passed_over_is_said_once(caplog):
    from kimik3.ops.cuda.loading import passed_over
    with caplog.at_level("WARNING"):
        for _ in range(3):
            passed_over("KIMIK3_TEST_LIBRARY", "a reason only this test gives", "our kernels run")
    said = [r for r in caplog.records if "a reason only this test gives" in r.getMessage()]
    assert len(said) == 1 and "KIMIK3_TEST_LIBRARY" in said[0].getMessage()
