"""A linear cost model fitted online (``controller.py``'s step and draft costs): decayed least squares with a
weak prior per coefficient and outlier clipping.

Plain Python floats, not numpy: the fits have 4-5 coefficients and are updated once per engine step, right after
the model's forward has evicted the caches, where numpy's per-call overhead dominated (at batch 32 on a CPU the
update, a 4 x 4 ``numpy.linalg.solve`` among a dozen array operations, took 0.18 ms of a 45 ms step; with caches
evicted by a matmul between calls 0.22 ms with numpy, 0.09 ms on floats)."""

from __future__ import annotations

COST_DECAY = 0.99        # the fits' memory (about 100 steps)


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a @ x = b (Gaussian elimination with partial pivoting; ``a`` square and non-singular)."""
    n = len(b)
    m = [list(row) + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        top = m[c]
        for r in range(c + 1, n):
            row = m[r]
            f = row[c] / top[c]
            if f:
                for k in range(c, n + 1):
                    row[k] -= f * top[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        x[r] = (row[n] - sum(row[k] * x[k] for k in range(r + 1, n))) / row[r]
    return x


class LinearFit:
    """y ~ x . beta by least squares over exponentially decayed observations, with ``prior`` as ``weight``
    pseudo-observations per coefficient (so coefficients that the data does not excite stay near it)."""

    def __init__(self, prior: list[float], scale: list[float], weight: float = 1.0, decay: float = COST_DECAY):
        n = len(prior)
        self.prior_a = [weight * s * s for s in scale]                   # a diagonal
        self.prior_b = [w * float(p) for w, p in zip(self.prior_a, prior)]
        self.a, self.b = [[0.0] * n for _ in range(n)], [0.0] * n
        self.decay = decay
        self.count = 0
        self._beta: list[float] | None = None

    def add(self, x: list[float], y: float) -> None:
        v = [float(e) for e in x]
        if self.count:                   # a step slowed by something else (another process, a page fault); from
            # the first: a coefficient few steps excite (a verify step's fixed cost while nothing drafts) kept the
            # first verify step's 0.5 s on a loaded machine, and no step drafted again
            p = self.predict(v)
            y = min(max(y, 0.6 * p), 1.7 * p + 1e-6)
        d = self.decay
        for row, vi in zip(self.a, v):
            for j, vj in enumerate(v):
                row[j] = row[j] * d + vi * vj
        self.b = [bi * d + vi * y for bi, vi in zip(self.b, v)]
        self.count += 1
        self._beta = None

    @property
    def beta(self) -> list[float]:
        if self._beta is None:
            a = [[e + (pa if i == j else 0.0) for j, e in enumerate(row)]
                 for i, (row, pa) in enumerate(zip(self.a, self.prior_a))]
            self._beta = solve(a, [bi + pb for bi, pb in zip(self.b, self.prior_b)])
        return self._beta

    def predict(self, x: list[float]) -> float:
        return sum(c * e for c, e in zip(self.beta, x))
