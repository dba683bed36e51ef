"""Host projections (``ops.linear.linear`` on the CPU): every row count, including the few-row range that
takes the weight-first GEMM (``KernelTuning.host_weight_first_rows``), against a float64 product written
element by element; the result row-major in the input's leading shape; the same numbers with that path off."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.linear import linear, linear_glu
from kimik3.ops.options import kernel_options, use_kernel_options

F64 = torch.float64


def _float64_product(x, w):
    x2, w2 = x.reshape(-1, x.shape[-1]).to(F64), w.to(F64)
    out = torch.empty(x2.shape[0], w2.shape[0], dtype=F64)
    for i in range(x2.shape[0]):
        out[i] = (w2 * x2[i]).sum(-1)
    return out.view(*x.shape[:-1], w.shape[0])


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 33])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_host_linear_matches_float64(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    N, K = 37, 70
    x = torch.randn(rows, K, generator=g, dtype=dtype)
    w = torch.randn(N, K, generator=g, dtype=dtype)
    ref = _float64_product(x, w)
    tol = 1e-12 if dtype == F64 else 2e-5
    y = linear(x, w)
    assert y.shape == (rows, N) and y.is_contiguous() and y.dtype == dtype
    torch.testing.assert_close(y.to(F64), ref, rtol=tol, atol=tol)
    with use_kernel_options(kernel_options().tuned(host_weight_first_rows=(0, -1))):
        torch.testing.assert_close(linear(x, w).to(F64), ref, rtol=tol, atol=tol)
    x3 = x.view(1, rows, K)                                # leading dims kept; an fp32 result on request
    y3 = linear(x3, w, out_dtype=F64)
    assert y3.shape == (1, rows, N) and y3.dtype == F64
    torch.testing.assert_close(y3[0], ref.to(dtype).to(F64), rtol=tol, atol=tol)


def test_host_linear_glu_of_few_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=g)
    w = torch.randn(2 * 16, 24, generator=g)
    gate, up = _float64_product(x, w).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(linear_glu(x, w, "silu", 1.0, None).to(F64), ref, rtol=2e-5, atol=2e-5)
