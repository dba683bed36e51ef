"""Fast paths from CUDA C++ libraries built outside the package (opt-in, loaded through ctypes): each
library is named by a ``KernelOptions`` path (an engine flag, its environment variable the fallback) and
built by a script in ``scripts/``."""
