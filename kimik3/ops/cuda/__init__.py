"""Fast paths from CUDA C++ libraries built outside the package (opt-in, loaded through ctypes): each
library is named by an environment variable and built by a script in ``scripts/``."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)


@functools.cache
def _load(env: str, path: str, declare: Callable[[ctypes.CDLL], None], build: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise RuntimeError(f"{env}={path}: cannot load the library ({exc}); build it with {build}, or unset the "
                           "variable to run the default kernels") from exc
    declare(lib)
    return lib


def library(env: str, declare: Callable[[ctypes.CDLL], None], build: str) -> ctypes.CDLL | None:
    """The library the variable ``env`` names (loaded once per path, its functions typed by ``declare``),
    or None when the variable is unset."""
    path = os.environ.get(env, "")
    return _load(env, path, declare, build) if path else None


@functools.cache
def passed_over(env: str, reason: str, fallback: str) -> None:
    """Say once per (variable, reason) that the library ``env`` names does not take some calls, and what runs
    them instead: a named library is never silently ignored."""
    logger.warning("%s names a library, but %s: %s", env, reason, fallback)
