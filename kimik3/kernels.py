"""The optional CUDA C++ libraries (FlashMLA's decode, FlashKDA's prefill), built into the user's cache by
``kimik3 build-kernels`` and found there at start-up with no variable to set.

Each library is one pinned upstream commit (and its pinned CUTLASS submodule) compiled with kimik3's C entry
point (``kimik3/ops/cuda/*_shim.cu``) for Hopper (sm_90a) by ``nvcc``. The file name carries the pin, so a
library built from another pin is not picked up (``installed`` says so and names the command that rebuilds it).

Where the cache is: ``--cache-dir``, else ``$KIMIK3_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/kimik3/kernels``,
else ``~/.cache/kimik3/kernels`` (read once, by ``cache_dir``; the engine resolves the paths when it is built).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHIMS = Path(__file__).resolve().parent / "ops" / "cuda"
BUILD_COMMAND = "kimik3 build-kernels"


@dataclass(frozen=True)
class KernelLibrary:
    name: str                       # "flash_mla" / "flash_kda"
    op: str                         # what it runs, for messages
    repo: str
    commit: str
    submodule: str                  # the CUTLASS submodule's path in the checkout
    submodule_commit: str
    sources: tuple[str, ...]        # .cu files of the checkout compiled beside the shim
    includes: tuple[str, ...]       # include folders of the checkout
    required: tuple[str, ...]       # files a usable checkout has (checked before compiling)
    flags: tuple[str, ...]

    @property
    def file_name(self) -> str:
        return f"libkimik3_{self.name}-{self.commit[:12]}.so"

    @property
    def shim(self) -> Path:
        return SHIMS / f"{self.name}_shim.cu"


_CUDA_FLAGS = ("-shared", "-Xcompiler", "-fPIC", "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
               "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
               "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
               "--use_fast_math", "-lineinfo")

LIBRARIES: dict[str, KernelLibrary] = {
    "flash_mla": KernelLibrary(
        name="flash_mla", op="MLA decode", repo="https://github.com/deepseek-ai/FlashMLA",
        commit="9241ae3ef9bac614dd25e45e507e089f888280e0",
        submodule="csrc/cutlass", submodule_commit="147f5673d0c1c3dcf66f78d677fd647e4a020219",
        sources=("csrc/sm90/decode/dense/instantiations/bf16.cu", "csrc/smxx/decode/combine/combine.cu",
                 "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu"),
        includes=("csrc/cutlass/include", "csrc/cutlass/tools/util/include", "csrc/kerutils/include", "csrc",
                  "csrc/sm90"),
        required=("csrc/params.h", "csrc/sm90/decode/dense/instantiations/bf16.cu",
                  "csrc/cutlass/include/cute/tensor.hpp"),
        flags=_CUDA_FLAGS + ("-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-DFLASH_MLA_DISABLE_FP16")),
    "flash_kda": KernelLibrary(
        name="flash_kda", op="KDA prefill", repo="https://github.com/MoonshotAI/FlashKDA",
        commit="1ce47ea3bb22c84eb9cc665028399cf35e8ffb0b",
        submodule="cutlass", submodule_commit="5c149f52a436782210263fb2f19b354443a61c6a",
        sources=("csrc/smxx/fwd_launch.cu",),
        includes=("cutlass/include", "cutlass/tools/util/include", "cutlass/examples/common", "csrc"),
        required=("csrc/fwd.h", "csrc/smxx/fwd_launch.cu", "cutlass/include/cute/tensor.hpp"),
        flags=_CUDA_FLAGS + ("-std=c++17",)),
}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where built libraries live (see the module's docstring for the order)."""
    if override:
        return Path(override)
    if os.environ.get("KIMIK3_CACHE_DIR"):
        return Path(os.environ["KIMIK3_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kimik3" / "kernels"


def installed(name: str, cache: str | os.PathLike | None = None) -> Path | None:
    """The built library ``name`` in the cache at its current pin, or None (a build of another pin is
    named in a log line with the command that rebuilds it)."""
    lib = LIBRARIES[name]
    folder = cache_dir(cache)
    path = folder / lib.file_name
    if path.is_file():
        return path
    stale = sorted(folder.glob(f"libkimik3_{name}-*.so")) if folder.is_dir() else []
    if stale:
        logger.warning("%s in %s was built from another %s commit than this kimik3 pins (%s): run `%s` to "
                       "rebuild it", stale[-1].name, folder, lib.name, lib.commit[:12], BUILD_COMMAND)
    return None


def _git(*args: str, cwd: Path | None = None) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def checkout(lib: KernelLibrary, dest: Path) -> Path:
    """A checkout of ``lib``'s pinned commit with its pinned submodule at ``dest`` (cloned once, reused)."""
    if shutil.which("git") is None:
        raise RuntimeError("building the kernels needs git to fetch the sources (or pass --source-dir with "
                           "checkouts made elsewhere)")
    if not (dest / ".git").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        _git("clone", "--quiet", lib.repo, str(dest))
    _git("-c", "advice.detachedHead=false", "checkout", "--quiet", lib.commit, cwd=dest)
    _git("submodule", "update", "--init", "--quiet", lib.submodule, cwd=dest)
    return dest


def check_sources(lib: KernelLibrary, src: Path) -> None:
    missing = [f for f in lib.required if not (src / f).is_file()]
    if missing:
        raise RuntimeError(f"{src} is not a {lib.repo} checkout with its {lib.submodule} submodule: "
                           f"{', '.join(missing)} missing (clone it at {lib.commit[:12]} with "
                           f"`git submodule update --init {lib.submodule}`)")


def nvcc_command(lib: KernelLibrary, src: Path, out: Path, nvcc: str = "nvcc") -> list[str]:
    return [nvcc, *lib.flags, *(f"-I{src / inc}" for inc in lib.includes), str(lib.shim),
            *(str(src / s) for s in lib.sources), "-o", str(out)]


def build(name: str, *, source: str | os.PathLike | None = None, cache: str | os.PathLike | None = None,
          nvcc: str = "nvcc") -> Path:
    """Build library ``name`` into the cache and return its path. ``source``: an existing checkout (at the
    pinned commit, with its submodule); else the pinned sources are cloned into the cache's ``src/``."""
    if name not in LIBRARIES:
        raise ValueError(f"unknown kernel library {name!r}; known: {', '.join(LIBRARIES)}")
    lib = LIBRARIES[name]
    if shutil.which(nvcc) is None:
        raise RuntimeError(f"{nvcc!r} not found: building {name} needs CUDA's compiler (12.9 or newer, for "
                           "sm_90a); install the CUDA toolkit or pass --nvcc PATH")
    folder = cache_dir(cache)
    src = Path(source) if source else checkout(lib, folder / "src" / name)
    check_sources(lib, src)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / lib.file_name
        logger.info("building %s (%s) from %s: a minute or two", lib.file_name, lib.op, src)
        done = subprocess.run(nvcc_command(lib, src, out, nvcc), capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"nvcc failed building {name} (exit {done.returncode}):\n{done.stderr[-4000:]}")
        final = folder / lib.file_name
        os.replace(out, final)                    # atomic: a half-written library is never found
    logger.info("built %s", final)
    return final


def describe_kernels(flash_mla: str | None, flash_kda: str | None) -> list[str]:
    """One line per op with a choice of library: what runs it and why (logged when a CUDA engine is built)."""
    def line(lib: KernelLibrary, path: str | None, ours: str, gain: str) -> str:
        if path:
            return f"{lib.op}: {lib.repo.rsplit('/', 1)[1]} ({path}; where a call does not fit it, {ours})"
        return (f"{lib.op}: {ours}; {lib.repo.rsplit('/', 1)[1]} is faster on Hopper ({gain}): `{BUILD_COMMAND} "
                f"{lib.name}` builds it into {cache_dir()}, where the next start finds it")
    return [line(LIBRARIES["flash_mla"], flash_mla, "kimik3's Triton split-K decode",
                 "1.07-1.10x of the bytes floor at 8k-1M tokens against 1.40-1.67x, H100"),
            line(LIBRARIES["flash_kda"], flash_kda, "fla-core's chunk_kda",
                 "K3's KDA prefill 2.0-3.1x fla-core's chunk_kda, H100")]
