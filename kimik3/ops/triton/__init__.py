"""Triton kernels behind the CUDA branches of ``kimik3.ops`` (each beside its torch reference
in the op module; imported lazily so CPU runs never touch Triton)."""
