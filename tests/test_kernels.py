"""``kimik3 build-kernels`` and the cache the engine finds the libraries in: the nvcc command it runs (with a
stand-in compiler that records its arguments and writes the output), the pinned file names, stale builds, and
the errors for a bad checkout, a failed compile or a missing compiler."""

from __future__ import annotations

import logging
import stat
import sys
from pathlib import Path

import pytest

from kimik3 import kernels
from kimik3.cli import main

FAKE_NVCC = """#!{python}
import sys, json, pathlib
args = sys.argv[1:]
pathlib.Path({log!r}).write_text(json.dumps(args))
if {fail}:
    print("error: something broke", file=sys.stderr); sys.exit(3)
pathlib.Path(args[args.index("-o") + 1]).write_bytes(b"\\x7fELF fake")
"""


def fake_nvcc(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    log = tmp_path / "nvcc_args.json"
    nvcc = tmp_path / ("nvcc_fail" if fail else "nvcc")
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable, log=str(log), fail=fail))
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return nvcc, log


def fake_checkout(tmp_path: Path, name: str) -> Path:
    src = tmp_path / f"src_{name}"
    for f in kernels.LIBRARIES[name].required:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("// stand-in\n")
    return src


@pytest.mark.parametrize("name", sorted(kernels.LIBRARIES))
def test_build_runs_nvcc_on_the_shim_and_the_pinned_sources_and_installs(tmp_path, name):
    import json
    lib = kernels.LIBRARIES[name]
    nvcc, log = fake_nvcc(tmp_path)
    src, cache = fake_checkout(tmp_path, name), tmp_path / "cache"
    assert kernels.installed(name, cache) is None
    path = kernels.build(name, source=src, cache=cache, nvcc=str(nvcc))
    assert path == cache / f"libkimik3_{name}-{lib.commit[:12]}.so" and path.read_bytes() == b"\x7fELF fake"
    assert kernels.installed(name, cache) == path
    args = json.loads(log.read_text())
    assert "arch=compute_90a,code=sm_90a" in args and "-shared" in args
    assert str(kernels.SHIMS / f"{name}_shim.cu") in args and Path(args[args.index(str(lib.shim))]).is_file()
    for s in lib.sources:
        assert str(src / s) in args
    for inc in lib.includes:
        assert f"-I{src / inc}" in args
    assert not list(cache.glob("tmp*")), "the temporary build folder is left behind"


def test_a_build_of_another_pin_is_not_used_and_is_named(tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "libkimik3_flash_mla-0123456789ab.so").write_bytes(b"old")
    with caplog.at_level(logging.WARNING, logger="kimik3.kernels"):
        assert kernels.installed("flash_mla", cache) is None
    assert "another flash_mla commit" in caplog.text and "kimik3 build-kernels" in caplog.text


def test_bad_checkout_failed_compile_and_missing_compiler_are_clear_errors(tmp_path):
    nvcc, _ = fake_nvcc(tmp_path)
    with pytest.raises(RuntimeError, match=r"csrc/fwd\.h.*missing"):
        kernels.build("flash_kda", source=tmp_path / "empty", cache=tmp_path / "c", nvcc=str(nvcc))
    bad, _ = fake_nvcc(tmp_path, fail=True)
    with pytest.raises(RuntimeError, match=r"nvcc failed building flash_kda \(exit 3\):\nerror: something broke"):
        kernels.build("flash_kda", source=fake_checkout(tmp_path, "flash_kda"), cache=tmp_path / "c", nvcc=str(bad))
    assert kernels.installed("flash_kda", tmp_path / "c") is None
    with pytest.raises(RuntimeError, match="not found: building flash_kda needs CUDA's compiler"):
        kernels.build("flash_kda", source=tmp_path, cache=tmp_path / "c", nvcc=str(tmp_path / "no-nvcc"))
    with pytest.raises(ValueError, match="unknown kernel library 'flash_x'; known: flash_mla, flash_kda"):
        kernels.build("flash_x")


def test_cache_dir_order(tmp_path, monkeypatch):
    monkeypatch.delenv("KIMIK3_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels.cache_dir() == tmp_path / "xdg" / "kimik3" / "kernels"
    monkeypatch.setenv("KIMIK3_CACHE_DIR", str(tmp_path / "k"))
    assert kernels.cache_dir() == tmp_path / "k" / "kernels"
    assert kernels.cache_dir(tmp_path / "given") == tmp_path / "given"


def test_cli_build_kernels(tmp_path, capsys):
    nvcc, _ = fake_nvcc(tmp_path)
    src = fake_checkout(tmp_path, "flash_kda")
    rc = main(["build-kernels", "flash_kda", "--flash-kda-source", str(src), "--cache-dir", str(tmp_path / "c"),
               "--nvcc", str(nvcc)])
    assert rc == 0 and capsys.readouterr().out.strip() == str(kernels.installed("flash_kda", tmp_path / "c"))
    assert main(["build-kernels", "flash_x"]) == 2
    assert "unknown kernel library flash_x; known: flash_mla, flash_kda" in capsys.readouterr().err


def test_shims_ship_with_the_package():
    root = Path(kernels.__file__).resolve().parents[1]
    text = (root / "pyproject.toml").read_text()
    assert '"ops/cuda/*.cu"' in text
    for lib in kernels.LIBRARIES.values():
        assert lib.shim.is_file()


def test_the_engine_finds_a_built_library_with_no_variable_and_none_turns_it_off(tmp_path, monkeypatch):
    from kimik3.engine.args import EngineArgs
    monkeypatch.setenv("KIMIK3_CACHE_DIR", str(tmp_path))
    for v in ("KIMIK3_FLASH_MLA", "KIMIK3_FLASH_KDA"):
        monkeypatch.delenv(v, raising=False)
    assert EngineArgs().kernel_options().flash_mla is None                     # nothing built
    nvcc, _ = fake_nvcc(tmp_path)
    built = kernels.build("flash_mla", source=fake_checkout(tmp_path, "flash_mla"), nvcc=str(nvcc))
    assert built.parent == tmp_path / "kernels"
    opts = EngineArgs().kernel_options()
    assert opts.flash_mla == str(built) and opts.flash_kda is None
    assert EngineArgs(flash_mla="none").kernel_options().flash_mla is None
    assert EngineArgs(flash_mla="/elsewhere/lib.so").kernel_options().flash_mla == "/elsewhere/lib.so"
    monkeypatch.setenv("KIMIK3_FLASH_MLA", "none")
    assert EngineArgs().kernel_options().flash_mla is None
    import torch
    assert EngineArgs(flash_mla="none").resolve_block_size(torch.device("cuda")) == 16
    assert EngineArgs(flash_mla=str(built)).resolve_block_size(torch.device("cuda")) == 64


def test_start_up_lines_name_what_runs_each_op_and_how_to_get_the_faster_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMIK3_CACHE_DIR", str(tmp_path))
    mla, kda = kernels.describe_kernels(None, None)
    assert mla.startswith("MLA decode: kimik3's Triton split-K decode; FlashMLA is faster")
    assert f"`kimik3 build-kernels flash_mla` builds it into {tmp_path / 'kernels'}" in mla
    assert kda.startswith("KDA prefill: fla-core's chunk_kda; FlashKDA is faster")
    mla, kda = kernels.describe_kernels("/x/libkimik3_flash_mla.so", "/x/kda.so")
    assert mla.startswith("MLA decode: FlashMLA (/x/libkimik3_flash_mla.so;") and "kda.so" in kda
