"""Operators: each public function has a plain-torch reference (the CPU path and the test
oracle) and, where one exists, a fast CUDA path chosen inside the same function."""

from kimik3.ops.arith import ceil_div  # noqa: F401  (kimik3.ops.ceil_div: the name the engine and model use)
