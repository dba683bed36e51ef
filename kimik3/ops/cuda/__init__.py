"""Fast paths from CUDA C++ libraries built outside the package (opt-in, loaded through ctypes)."""
