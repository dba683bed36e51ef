import os

# Our Triton kernels run on CPU tensors through Triton's interpreter here; the variable must be
# set before ``triton.jit`` wraps them (the kernel modules are only imported by the tests below).
os.environ.setdefault("TRITON_INTERPRET", "1")
