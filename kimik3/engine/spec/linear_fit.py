"""A linear cost model fitted online (``controller.py``'s step and draft costs): decayed least squares with a
weak prior per coefficient and outlier clipping."""

from __future__ import annotations

import numpy as np

COST_DECAY = 0.99        # the fits' memory (about 100 steps)


class LinearFit:
    """y ~ x . beta by least squares over exponentially decayed observations, with ``prior`` as ``weight``
    pseudo-observations per coefficient (so coefficients that the data does not excite stay near it)."""

    def __init__(self, prior: list[float], scale: list[float], weight: float = 1.0, decay: float = COST_DECAY):
        n = len(prior)
        s = np.asarray(scale, dtype=np.float64)
        self.prior_a = np.diag(weight * s * s)
        self.prior_b = self.prior_a @ np.asarray(prior, dtype=np.float64)
        self.a, self.b = np.zeros((n, n)), np.zeros(n)
        self.decay = decay
        self.count = 0
        self._beta: np.ndarray | None = None

    def add(self, x: list[float], y: float) -> None:
        v = np.asarray(x, dtype=np.float64)
        if self.count:                   # a step slowed by something else (another process, a page fault); from
            # the first: a coefficient few steps excite (a verify step's fixed cost while nothing drafts) kept the
            # first verify step's 0.5 s on a loaded machine, and no step drafted again
            p = float(np.dot(self.beta, v))
            y = float(np.clip(y, 0.6 * p, 1.7 * p + 1e-6))
        self.a = self.a * self.decay + np.outer(v, v)
        self.b = self.b * self.decay + v * y
        self.count += 1
        self._beta = None

    @property
    def beta(self) -> np.ndarray:
        if self._beta is None:
            self._beta = np.linalg.solve(self.a + self.prior_a, self.b + self.prior_b)
        return self._beta

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.beta, np.asarray(x, dtype=np.float64)))
