"""tests/helpers.py: the per-piece bound catches what one global norm lets through."""

import pytest
import torch

from tests.helpers import rel_err, worst_rel_err


def test_a_bad_one_token_sequence_fails_the_per_sequence_bound_only():
    g = torch.Generator().manual_seed(0)
    lens = [300, 1, 120]
    ref = torch.randn(sum(lens), 8, 16, generator=g, dtype=torch.float64)
    out = ref.clone()
    out[300] *= 1.1                                  # 10% off in the one-token sequence
    assert rel_err(out, ref) < 1e-2                  # invisible in the global norm
    assert worst_rel_err(out, ref, lens) == pytest.approx(0.1)
    assert worst_rel_err(out, ref) == pytest.approx(0.1)        # per token
    assert worst_rel_err(ref, ref, lens) == 0.0


def test_non_finite_and_mismatched_inputs():
    ref = torch.ones(4, 2)
    bad = ref.clone()
    bad[3, 1] = float("nan")
    assert rel_err(bad, ref) == float("inf") and worst_rel_err(bad, ref, [3, 1]) == float("inf")
    with pytest.raises(ValueError, match="sum to 3"):
        worst_rel_err(ref, ref, [2, 1])
    with pytest.raises(ValueError, match="shapes differ"):
        worst_rel_err(ref, ref[:3])
