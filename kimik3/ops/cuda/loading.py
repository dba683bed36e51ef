"""Loading a library a ``KernelOptions`` path names (once per path, its functions typed), and saying once when
one passes some calls over to our kernels."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


@functools.cache
def _load(name: str, path: str, declare: Callable[[ctypes.CDLL], None], build: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise RuntimeError(f"{name} = {path}: cannot load the library ({exc}); build it with {build}, or leave the "
                           "option unset to run the default kernels") from exc
    declare(lib)
    return lib


def library(name: str, path: str | None, declare: Callable[[ctypes.CDLL], None], build: str) -> ctypes.CDLL | None:
    """The library at ``path`` (the option ``name``; loaded once per path, its functions typed by ``declare``),
    or None when no path is given."""
    return _load(name, path, declare, build) if path else None


@functools.cache
def passed_over(name: str, reason: str, fallback: str) -> None:
    """Say once per (option, reason) that the library the option ``name`` names does not take some calls, and
    what runs them instead: a named library is never silently ignored."""
    logger.warning("%s names a library, but %s: %s", name, reason, fallback)
