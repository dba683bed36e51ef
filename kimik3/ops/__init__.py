"""Operators: each public function has a plain-torch reference (the CPU path and the test
oracle) and, where one exists, a fast CUDA path chosen inside the same function."""
