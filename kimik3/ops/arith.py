"""Integer arithmetic the ops and the engine share."""


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers b > 0 (blocks of b covering a items), exact at any size."""
    return -(-a // b)
