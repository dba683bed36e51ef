"""Operators: each public function has a plain-torch reference (the CPU path and the test
oracle) and, where one exists, a fast CUDA path chosen inside the same function."""


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers b > 0 (blocks of b covering a items), exact at any size."""
    return -(-a // b)
