"""FP8 weights (``--quantization fp8``): ``ops.linear.fp8_linear`` on the CPU (e4m3 round trips) and the Triton
kernel (TRITON_INTERPRET=1, ragged shapes) against float64 products of the dequantised operands."""

import pytest
import torch

from kimik3.ops import fp8
from kimik3.ops.linear import FP8_GEMV_MAX_ROWS, fp8_linear, linear, linear_glu
from tests.helpers import rel_err

BF16 = torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(N, K, block, g):
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    w[3] *= 20                                                    # a loud output channel
    codes, scale = fp8.quantize_weight(w, block)
    return w, codes, (scale.view(-1) if block is None else scale)


def _dq(codes, scale):
    return fp8.dequantize_weight(codes, scale.view(-1, 1) if scale.dim() == 1 else scale, torch.float64)


@pytest.mark.parametrize("block", [None, 128], ids=["channel", "block"])
@pytest.mark.parametrize("M", [1, FP8_GEMV_MAX_ROWS, 40], ids=["decode1", "decode16", "prefill"])
def test_reference_is_the_product_of_the_round_tripped_operands(M, block):
    """Up to FP8_GEMV_MAX_ROWS rows x as it is, above them x quantised per token (per 128 columns for block
    weights); the weight within the E4M3 bound of its float64 values; the product as float64's within fp32."""
    g = gen(M)
    N, K = 200, 300
    w, codes, scale = _weight(N, K, block, g)
    wd = _dq(codes, scale)
    bound = torch.maximum(fp8.ROUNDING_BOUND * w.abs(), fp8.SUBNORMAL_STEP / 2 * fp8.expand_weight_scale(
        scale.view(-1, 1) if block is None else scale, N, K).double())
    assert ((wd - w).abs() <= bound * (1 + 1e-6)).all()
    x = torch.randn(M, K, generator=g)
    y = fp8_linear(x, codes, scale)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    if M > FP8_GEMV_MAX_ROWS:
        xd = fp8.dequantize_activations(*fp8.quantize_activations(x, 128 if block else None), torch.float64)
        assert rel_err(xd, x.double()) < 2 ** -4 and not torch.equal(xd.float(), x)
    else:
        xd = x.double()
    assert rel_err(y, xd @ wd.t()) < 1e-6
    assert rel_err(y, x.double() @ w.t()) < 0.05                        # and near the unquantised product
    assert torch.equal(linear(x.view(1, M, K), codes, weight_scale=scale).view(M, N), y)      # the ops entry point


def test_glu_over_fp8_weights_is_the_activation_of_the_two_products():
    g = gen(7)
    _, codes, scale = _weight(64, 96, None, g)
    x = torch.randn(3, 96, generator=g)
    y = linear_glu(x, codes, "silu", 1.0, None, weight_scale=scale)
    gate, up = fp8_linear(x, codes, scale).chunk(2, dim=-1)
    assert torch.equal(y, torch.nn.functional.silu(gate) * up)


triton = pytest.importorskip("triton")


@pytest.mark.parametrize("block", [None, 128], ids=["channel", "block"])
@pytest.mark.parametrize("M,N,K,quant", [(1, 200, 300, False), (16, 72, 130, False), (37, 200, 300, True),
                                         (5, 130, 260, True)],
                         ids=["gemv1", "gemv16-ragged", "gemm", "gemm-ragged"])
def test_fp8_matmul_kernel_matches_float64(M, N, K, quant, block):
    """The kernel over ragged M / N / K (tiles past the edges masked; output poisoned with NaN before): decode
    mode (bf16 x, E4M3 weight) and prefill mode (E4M3 x with per-token or per-128-column scales)."""
    from kimik3.ops.triton.fp8_linear import Fp8Tiles, fp8_matmul
    g = gen(M + N)
    _, codes, scale = _weight(N, K, block, g)
    x = torch.randn(M, K, generator=g).to(BF16)
    real_empty = torch.empty
    tiles = Fp8Tiles(16, 32, 128, 4, 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        if quant:
            for group in (128, None):
                xq, sx = fp8.quantize_activations(x, group)
                y = fp8_matmul(xq, codes, scale, BF16, x_scale=sx, tiles=tiles)
                want = fp8.dequantize_activations(xq, sx, torch.float64) @ _dq(codes, scale).t()
                assert y.dtype == BF16 and rel_err(y, want) < 2 ** -7, group
        else:
            y = fp8_matmul(x, codes, scale, BF16, tiles=tiles)
            assert y.dtype == BF16 and rel_err(y, x.double() @ _dq(codes, scale).t()) < 2 ** -7
    assert torch.isfinite(y).all()


def test_fp8_matmul_refuses_mismatched_operands():
    from kimik3.ops.triton.fp8_linear import fp8_matmul
    codes, scale = fp8.quantize_weight(torch.randn(64, 96), None)
    x = torch.zeros(2, 96, dtype=BF16)
    with pytest.raises(ValueError, match="do not match"):
        fp8_matmul(x, codes, scale.view(-1, 1), BF16)                  # a per-channel scale as [N, 1]
    with pytest.raises(ValueError, match="do not match"):
        fp8_matmul(x[:, :64], codes, scale.view(-1), BF16)            # K disagrees
    with pytest.raises(ValueError, match="do not match"):
        fp8_matmul(x, codes.to(BF16), scale.view(-1), BF16)           # not E4M3
